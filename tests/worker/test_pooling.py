"""The pooling runner against transformers: the pooled, normalized final hidden state of a small random model
(LAST and MEAN, chunked, batched, with a prefix-cache hit for LAST) within 1e-4, cosine >= 0.9999; and the
pooling config read from a sentence-transformers folder as vLLM reads it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from steploop.common.pooling_params import PoolingConfig, PoolingParams
from steploop.common.sampling_params import SamplingParams
from steploop.common.step_contract import NewRequestData, StepPlan
from steploop.gpu_worker.pooling import has_sentence_transformers_config, load_pooling_config
from tests.worker.family_models import build_family_model

BLOCK = 16


def write_sentence_transformers(folder, mode: str | None, normalize: bool, extra: list | None = None) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if mode:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (folder / "1_Pooling").mkdir(exist_ok=True)
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 128, "pooling_mode_cls_token": mode == "cls_token",
             "pooling_mode_mean_tokens": mode == "mean_tokens", "pooling_mode_max_tokens": False,
             "pooling_mode_lasttoken": mode == "lasttoken", "include_prompt": True}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules + (extra or [])))


def test_pooling_config_as_vllm_reads_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [32, 64]}))
    assert load_pooling_config(tmp_path, 128) == PoolingConfig("LAST", True, 128, True, (32, 64))
    assert not has_sentence_transformers_config(tmp_path)       # --runner auto: generate
    write_sentence_transformers(tmp_path, "mean_tokens", True)
    assert has_sentence_transformers_config(tmp_path)           # --runner auto: pooling
    assert load_pooling_config(tmp_path, 128).pooling_type == "MEAN"
    write_sentence_transformers(tmp_path, "lasttoken", False)
    assert (load_pooling_config(tmp_path, 128).pooling_type, load_pooling_config(tmp_path, 128).normalize) == \
        ("LAST", False)
    write_sentence_transformers(tmp_path, "cls_token", True)
    assert load_pooling_config(tmp_path, 128).pooling_type == "CLS"
    write_sentence_transformers(tmp_path, "mean_tokens", True, [{"idx": 3, "name": "3", "path": "3_Dense",
                                                                  "type": "sentence_transformers.models.Dense"}])
    with pytest.raises(ValueError, match="Dense"):
        load_pooling_config(tmp_path, 128)
    write_sentence_transformers(tmp_path, None, True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    write_sentence_transformers(tmp_path, None, True, [{"idx": 1, "name": "1", "path": "1_Pooling",
                                                        "type": "sentence_transformers.models.Pooling"}])
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        load_pooling_config(tmp_path, 128)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory, model_dir):
    return build_family_model("qwen3", tmp_path_factory.mktemp("pool-qwen3"), model_dir, seed=3)


def make_runner(folder):
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.model_runner import ModelRunner
    return ModelRunner.from_config(WorkerConfig(model=str(folder), num_kv_blocks=64, max_model_len=256,
                                                device="cpu", runner="pooling"), folder)


def reference(folder, prompt: list[int], kind: str) -> torch.Tensor:
    from transformers import AutoModel
    model = AutoModel.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[kind]
    return torch.nn.functional.normalize(pooled, dim=-1)


def run_pooling(runner, prompts: dict[int, list[int]], chunk: int, hits: dict[int, tuple[list[int], int]] | None = None):
    """Schedules min(chunk, left) tokens of every request per step; hits: handle -> (cached blocks, tokens)."""
    hits, step, state = hits or {}, 0, {}
    next_block = 1 + max((b for cached, _ in hits.values() for b in cached), default=20)   # past earlier runs'
    for h, prompt in prompts.items():
        blocks, done = hits.get(h, ([], 0))
        need = -(-len(prompt) // BLOCK) - len(blocks)
        state[h] = [list(blocks) + list(range(next_block, next_block + need)), done, False]
        next_block += need
    vectors = {}
    while len(vectors) < len(prompts):
        plan = StepPlan(step_id=step)
        step += 1
        for h, prompt in prompts.items():
            blocks, done, sent = state[h]
            if h in vectors or done >= len(prompt):
                continue
            if not sent:
                plan.new_requests.append(NewRequestData(h, prompt, [], SamplingParams(), blocks, done,
                                                        pooling=PoolingParams()))
                state[h][2] = True
            n = min(chunk, len(prompt) - done)
            plan.scheduled_handles.append(h)
            plan.num_scheduled_tokens.append(n)
            state[h][1] = done + n
        result = runner.execute(plan)
        assert not result.error, result.error
        vectors.update(result.pooled)
    runner.execute(StepPlan(step_id=step, finished_handles=list(prompts)))
    return vectors, {h: s[0] for h, s in state.items()}


def assert_close(got: list[float], want: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert (got_t - want).abs().max().item() < 1e-4
    assert torch.nn.functional.cosine_similarity(got_t, want, dim=0).item() >= 0.9999


PROMPTS = {1: list(range(100, 141)), 2: list(range(100, 120)) + [7, 8, 9], 3: [5000, 17, 4242, 99] * 9}


@pytest.mark.parametrize("chunk", [7, 256])
def test_last_token_pooling_matches_transformers(random_model, chunk):
    runner = make_runner(random_model)
    vectors, blocks = run_pooling(runner, PROMPTS, chunk)
    for h, prompt in PROMPTS.items():
        assert_close(vectors[h], reference(random_model, prompt, "LAST"))
    # A prefix-cache hit (request 1's first block, same 16 tokens): the last token is computed, same vector.
    again = {4: PROMPTS[1][:16] + [3, 1, 4, 1, 5]}
    vectors, _ = run_pooling(runner, again, chunk, {4: (blocks[1][:1], BLOCK)})
    assert_close(vectors[4], reference(random_model, again[4], "LAST"))


def test_mean_and_cls_pooling_match_transformers(random_model, tmp_path):
    for mode, kind in (("mean_tokens", "MEAN"), ("cls_token", "CLS")):
        folder = tmp_path / kind
        shutil.copytree(random_model, folder)
        write_sentence_transformers(folder, mode, True)
        runner = make_runner(folder)
        assert runner.info.runner == "pooling" and runner.info.pooling.pooling_type == kind
        vectors, _ = run_pooling(runner, PROMPTS, chunk=5)
        for h, prompt in PROMPTS.items():
            assert_close(vectors[h], reference(folder, prompt, kind))


def test_matryoshka_dimensions_truncate_before_normalizing(random_model, tmp_path):
    folder = tmp_path / "matryoshka"
    shutil.copytree(random_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [32, 128]}))
    runner = make_runner(folder)
    assert runner.info.pooling == PoolingConfig("LAST", True, 128, True, (32, 128))
    prompt = PROMPTS[1]
    plan = StepPlan(step_id=0, new_requests=[NewRequestData(1, prompt, [], SamplingParams(), [1, 2, 3], 0,
                                                            pooling=PoolingParams(dimensions=32))],
                    scheduled_handles=[1], num_scheduled_tokens=[len(prompt)])
    vector = runner.execute(plan).pooled[1]
    assert len(vector) == 32
    full = reference(folder, prompt, "LAST")     # normalized; truncating and renormalizing it is the same
    assert_close(vector, torch.nn.functional.normalize(full[:32], dim=-1))
