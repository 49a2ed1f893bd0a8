"""Weights in memory for a GGUF file read at its own width: a Llama-3.2-1B-shaped Q4_K_M-like file (random valid
blocks: Q4_K, with Q6_K for attn_v, ffn_down and the output, F32 norms; the default model's tokenizer) written to a
temp folder, loaded by the ModelRunner on the CPU, one greedy step run:
    python -m benchmarks.gguf_memory [--layers 16] [--out /tmp/gguf-memory]

Reports the file's size, the worker's "GGUF weights in memory" line, and the process's resident size before
loading, after, and its peak (ru_maxrss). Writes benchmarks/results/gguf_memory.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import resource
import time

import numpy as np

from benchmarks.machine import machine_info

RESULTS = pathlib.Path(__file__).parent / "results" / "gguf_memory.json"
HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM = 2048, 8192, 32, 8, 64


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def write_file(path: pathlib.Path, layers: int, tokenizer_dir: pathlib.Path) -> None:
    import gguf
    from gguf import GGMLQuantizationType as T

    from tests.worker.gguf_files import _add_tokenizer, quantize
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("gguf-memory-1b")
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(MLP)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    _add_tokenizer(writer, tokenizer_dir, unigram=False)
    vocab = 49152                   # the default model's tokenizer
    writer.add_vocab_size(vocab)

    def blocks(name: str, rows: int, cols: int, qtype: T, seed: int) -> None:
        # quantize() only reads w's shape for the k-quants (random valid blocks)
        writer.add_tensor(name, quantize(np.empty((rows, cols), np.float32), qtype, seed), raw_dtype=qtype)

    blocks("token_embd.weight", vocab, HIDDEN, T.Q4_K, 0)
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(HIDDEN, np.float32))
        blocks(p + "attn_q.weight", HEADS * HEAD_DIM, HIDDEN, T.Q4_K, 10 * i + 1)
        blocks(p + "attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN, T.Q4_K, 10 * i + 2)
        blocks(p + "attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN, T.Q6_K, 10 * i + 3)
        blocks(p + "attn_output.weight", HIDDEN, HEADS * HEAD_DIM, T.Q4_K, 10 * i + 4)
        blocks(p + "ffn_gate.weight", MLP, HIDDEN, T.Q4_K, 10 * i + 5)
        blocks(p + "ffn_up.weight", MLP, HIDDEN, T.Q4_K, 10 * i + 6)
        blocks(p + "ffn_down.weight", HIDDEN, MLP, T.Q6_K, 10 * i + 7)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    blocks("output.weight", vocab, HIDDEN, T.Q6_K, 9)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/gguf-memory"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from steploop.common.model_path import default_model_dir
    tokenizer_dir = default_model_dir()                  # before the cache dir moves to the temp folder
    os.environ["STEPLOOP_CACHE_DIR"] = str(args.out / "cache")
    path = args.out / f"llama-1b-shaped-{args.layers}l-q4_k_m.gguf"
    if not path.is_file():
        write_file(path, args.layers, tokenizer_dir)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    logging.basicConfig(level=logging.INFO)
    logging.getLogger().addHandler(Keep())

    import torch

    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.gguf_convert import convert_gguf
    from steploop.gpu_worker.model_runner import ModelRunner
    folder = convert_gguf(path)
    before = rss_mib()
    start = time.perf_counter()
    runner = ModelRunner.from_config(WorkerConfig(model=str(path), num_kv_blocks=40, max_model_len=512,
                                                  device="cpu"), folder)
    load_s = time.perf_counter() - start
    after = rss_mib()
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 4]])
        runner.model.model.embed_tokens(ids)
    weights_line = next((line for line in lines if line.startswith("GGUF weights in memory")), None)
    result = {"file": path.name, "file_mib": round(path.stat().st_size / 2**20, 1), "layers": args.layers,
              "weights_in_memory": weights_line, "rss_before_load_mib": round(before, 1),
              "rss_after_load_mib": round(after, 1), "peak_rss_mib": round(resource.getrusage(
                  resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "load_seconds": round(load_s, 1)}
    print(json.dumps(result, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine_info(), **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
