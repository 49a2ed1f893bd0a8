"""Each supported family, exact against transformers: a small random model built from the family's transformers
config class (tests/worker/family_models.py), served by the worker's ModelRunner through the test driver.

Greedy tokens equal transformers' generate for several prompts longer than any sliding window, every sampled
token's logprob is within 1e-4 of transformers' log-softmax, whatever the prefill chunking, and after a preemption
(the request is recomputed from scratch, its outputs kept).
"""

from __future__ import annotations

import json

import pytest
import torch

from steploop.common.sampling_params import SamplingParams
from steploop.gpu_worker.config import WorkerConfig
from steploop.gpu_worker.model_runner import ModelRunner
from tests.worker.driver import Driver
from tests.worker.family_models import FAMILY_CONFIGS, WINDOW, build_family_model, load_oracle

pytestmark = pytest.mark.slow     # 15 families x 3 schedules: 13 min on 2 shared cores

PROMPT_LENS = (41, 57, 70)     # all longer than the 16-24-token windows
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def family(request, tmp_path_factory, model_dir):
    path = build_family_model(request.param, tmp_path_factory.mktemp(request.param), model_dir)
    config = WorkerConfig(model=str(path), num_kv_blocks=64, max_model_len=256, device="cpu")
    hf_model = load_oracle(path)
    return request.param, ModelRunner.from_config(config, path), [oracle(hf_model, p) for p in prompts()]


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def oracle(hf_model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy generate: (new tokens, each one's logprob)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, output_logits=True, return_dict_in_generate=True,
                                pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
    return tokens, logprobs


def serve(runner, chunk, preempt_after: int | None = None) -> dict[int, tuple[list[int], list[float]]]:
    runner.reset()
    driver = Driver(runner)
    for handle, prompt in enumerate(prompts()):
        driver.add(handle, prompt, NEW_TOKENS, SamplingParams(temperature=0.0, logprobs=0, max_tokens=NEW_TOKENS,
                                                              ignore_eos=True))
    logprobs: dict[int, list[float]] = {h: [] for h in range(len(PROMPT_LENS))}
    for step in range(300):
        if not driver.requests:
            break
        if preempt_after is not None and step == preempt_after and 1 in driver.requests:
            driver.preempt(1)
        result = driver.step(chunk)
        for handle, lps in result.logprobs.items():
            logprobs[handle].extend(lp.logprob for lp in lps)
    runner.reset()
    return {h: (driver.outputs[h], logprobs[h][-NEW_TOKENS:]) for h in logprobs}


@pytest.mark.parametrize("chunk, preempt_after", [(512, None), ({0: 7, 1: 64, 2: 5}, None), (16, 8)])
def test_greedy_tokens_and_logprobs_equal_transformers(family, chunk, preempt_after):
    name, runner, expected = family
    got = serve(runner, chunk, preempt_after)
    for handle, (want_tokens, want_logprobs) in enumerate(expected):
        tokens, logprobs = got[handle]
        assert tokens == want_tokens, f"{name} prompt {handle}: {tokens} != {want_tokens}"
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4), f"{name} prompt {handle}"


def test_the_window_matters_at_these_lengths(tmp_path, model_dir):
    """Control: the prompts are long enough that ignoring Mistral's window changes transformers' own output."""
    path = build_family_model("mistral", tmp_path, model_dir)
    windowed = load_oracle(path)
    full = load_oracle(path)
    full.config.sliding_window = None
    ids = torch.tensor([prompts()[0]])
    assert len(prompts()[0]) > 2 * WINDOW
    with torch.no_grad():
        diff = (windowed(ids).logits - full(ids).logits).abs().max().item()
    assert diff > 1e-2


def test_sharded_bf16_checkpoint_serves_exactly_on_cpu(tmp_path, model_dir):
    """An index file over several shards, torch_dtype bfloat16: the CPU worker reads every shard, computes in fp32
    (its --dtype auto) with the linears kept at 16 bits, and matches transformers' fp32 forward on the same
    (bf16-valued) weights."""
    path = build_family_model("qwen3", tmp_path, model_dir, dtype=torch.bfloat16, max_shard_size="2MB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) >= 2
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    runner = ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=64, max_model_len=256,
                                                  device="cpu"), path)
    # the linears, the table and its tied head stay 16-bit (model/half_weights.py)
    assert runner.model.lm_head.packed is runner.model.model.embed_tokens.packed is not None
    hf_model = load_oracle(path)          # dtype=float32: the bf16 values, upcast
    got = serve(runner, 13)
    for handle, prompt in enumerate(prompts()):
        tokens, logprobs = got[handle]
        want_tokens, want_logprobs = oracle(hf_model, prompt)
        assert tokens == want_tokens and logprobs == pytest.approx(want_logprobs, abs=1e-4)
