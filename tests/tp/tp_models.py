"""Small random Llama folders for the tensor-parallel tests (transformers' LlamaConfig, no downloads), and a
helper that runs N ranks of ModelRunner in threads of one process over a real gloo group on loopback."""

from __future__ import annotations

import pathlib
import threading
from datetime import timedelta

import torch

from tests.worker.family_models import TOKENIZER_FILES, VOCAB


def build_llama(out: pathlib.Path, tokenizer_dir: pathlib.Path, num_heads: int, num_kv_heads: int, tied: bool,
                seed: int = 0, dtype: torch.dtype = torch.float32) -> pathlib.Path:
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=32,
                         max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def run_ranks(model_dir: pathlib.Path, world_size: int, prompts: list[list[int]], max_tokens: int,
              chunk: int = 7, device: str = "cpu", runners: list | None = None) -> list[dict[int, list[int]]]:
    """Each rank's greedy outputs (handle -> tokens), every rank a ModelRunner in its own thread (fp32; on
    device "cuda" rank R uses cuda:R and NCCL). runners: a list that gets each rank's ModelRunner."""
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.distributed.process_group import GroupStore, form_group
    from steploop.gpu_worker.model_runner import ModelRunner
    from tests.worker.driver import Driver

    store = GroupStore("127.0.0.1", world_size)

    def rank_main(rank: int) -> dict[int, list[int]]:
        rank_device = f"cuda:{rank}" if device == "cuda" else "cpu"
        if device == "cuda":
            torch.cuda.set_device(rank)
        config = WorkerConfig(model=str(model_dir), num_kv_blocks=160, max_model_len=512, device=rank_device,
                              dtype="float32", tensor_parallel_size=world_size, rank=rank, num_threads=1)
        runner = ModelRunner.from_config(config, model_dir)
        if runners is not None:
            runners.append(runner)
        timeout = timedelta(seconds=120)
        group = form_group(rank, world_size, store.address, 1, timeout, "127.0.0.1", torch.device(rank_device),
                           store if rank == 0 else None)
        runner.tp_comm.attach(group, 1, timeout)
        driver = Driver(runner)
        for handle, prompt in enumerate(prompts):
            driver.add(handle, prompt, max_tokens)
        return driver.run(chunk=chunk)

    return each_rank_in_a_thread(world_size, rank_main)


def each_rank_in_a_thread(world_size: int, rank_main) -> list:
    """rank_main(rank) for every rank, each in its own thread (a collective needs them all at once); their
    results in rank order, or the first rank's exception raised."""
    outputs: list = [None] * world_size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            outputs[rank] = rank_main(rank)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return outputs
