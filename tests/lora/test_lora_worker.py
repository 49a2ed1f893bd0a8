"""The worker's LoRA path on the real model against transformers + peft: each adapter alone, and adapters mixed
with base requests in one batch (prompt chunks and decodes together). A step without adapters stays the base
path: the C decoder still runs it whole."""

from __future__ import annotations

import pytest

from steploop.common.lora_config import LoraConfig, LoraModule
from tests.worker.driver import Driver

EOS = 2
PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "List three colors:",
           "def fibonacci(n):", "Tell me about the moon and the stars and why", "1, 2, 3, 4,"]


class LoraRunner:
    """Gives the Driver's plans what the scheduler adds for LoRA: each new request's adapter and the folders."""

    def __init__(self, runner, adapter_of: dict[int, str | None], dirs: dict) -> None:
        self.runner, self.adapter_of, self.dirs, self.sent = runner, adapter_of, dirs, False

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, plan):
        for new in plan.new_requests:
            new.lora_name = self.adapter_of.get(new.handle) or ""
        if not self.sent:
            plan.lora_loads = [LoraModule(n, str(p)) for n, p in self.dirs.items()]
            self.sent = True
        return self.runner.execute(plan)


@pytest.fixture(scope="module")
def lora_runner(model_dir):
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.model_runner import ModelRunner

    config = WorkerConfig(model=str(model_dir), num_kv_blocks=256, max_model_len=512, device="cpu",
                          lora=LoraConfig(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2))
    return ModelRunner.from_config(config, model_dir)


def until_eos(ids: list[int]) -> list[int]:
    return ids[:ids.index(EOS)] if EOS in ids else ids


def run_mixed(lora_runner, peft_ref, adapter_dirs, assignment: list[str | None], chunk: int, max_tokens: int = 12):
    lora_runner.reset()
    tokenizer = peft_ref.tokenizer
    prompts = [tokenizer(p).input_ids for p in PROMPTS[:len(assignment)]]
    driver = Driver(LoraRunner(lora_runner, dict(enumerate(assignment)), adapter_dirs))
    for handle, prompt in enumerate(prompts):
        driver.add(handle, prompt, max_tokens)
    outputs = driver.run(chunk=chunk)
    for handle, (adapter, prompt) in enumerate(zip(assignment, prompts)):
        want = list(peft_ref.greedy_ids(adapter, tuple(prompt), max_tokens))
        assert until_eos(outputs[handle]) == want, f"request {handle} with adapter {adapter}"
    return prompts


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["attn8", "mlp16"])
def test_each_adapter_alone_matches_peft(lora_runner, peft_ref, adapter_dirs, adapter):
    prompts = run_mixed(lora_runner, peft_ref, adapter_dirs, [adapter, adapter], chunk=64)
    assert any(peft_ref.greedy_ids(adapter, tuple(p), 12) != peft_ref.greedy_ids(None, tuple(p), 12) for p in prompts), \
        "the adapter does not change the output: the comparison would prove nothing"


@pytest.mark.slow
def test_adapters_mixed_with_base_requests_in_one_batch_match_peft(lora_runner, peft_ref, adapter_dirs):
    run_mixed(lora_runner, peft_ref, adapter_dirs, ["attn8", None, "mlp16", None, "mlp16", "attn8"], chunk=5)


@pytest.mark.slow
def test_a_step_without_adapters_runs_the_base_path(lora_runner, peft_ref, adapter_dirs):
    layers = lora_runner.model.lora
    seen = []
    original = layers.begin
    layers.begin = lambda *a: (seen.append(True), original(*a))[1]
    try:
        run_mixed(lora_runner, peft_ref, adapter_dirs, [None, None], chunk=64)
    finally:
        layers.begin = original
    assert not seen and not layers.active
