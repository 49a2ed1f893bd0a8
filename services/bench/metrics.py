"""Per-request timelines -> the figures vLLM's `bench serve` reports, defined the same way.

    TTFT  = time from sending the request to the first streamed chunk that carries output
    ITL   = gaps between successive output chunks; a chunk carrying k tokens adds k gaps of gap/k each
    TPOT  = (e2e latency - TTFT) / (output_tokens - 1), per request with more than one output token
    E2EL  = time from sending the request to the last byte of the response
Throughputs divide by the benchmark's wall time (first send to last response). Goodput counts only the requests
that meet every SLO given (`ttft:ms tpot:ms e2el:ms`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds."""

    success: bool = False
    prompt_len: int = 0                  # prompt tokens (server usage when given, else the dataset's count)
    output_tokens: int = 0               # completion tokens (server usage when given, else tokenizer count)
    ttft: float = 0.0
    latency: float = 0.0                 # e2e
    itl: list[float] = field(default_factory=list)   # [output_tokens - 1] gaps, spread evenly per chunk
    start_time: float = 0.0              # perf_counter when sent (relative times in plots)
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def spread_itl(chunk_times: list[float], chunk_tokens: list[int]) -> list[float]:
    """ITL from chunk arrival times: each chunk's gap split evenly over the tokens it carries.
    chunk_times[0] is the first output chunk: its tokens after the first arrived with it (gaps of 0)."""
    itl: list[float] = [0.0] * (max(1, chunk_tokens[0]) - 1) if chunk_tokens else []
    for i in range(1, len(chunk_times)):
        k = max(1, chunk_tokens[i])
        itl.extend([(chunk_times[i] - chunk_times[i - 1]) / k] * k)
    return itl


def distribute_tokens(weights: list[int], total: int) -> list[int]:
    """Split `total` tokens over chunks in proportion to `weights` (largest remainder), each chunk >= 1 when
    total allows. Used when the server reports only the total (usage) and chunks may carry several tokens."""
    n = len(weights)
    if n == 0:
        return []
    if total <= n:
        return [1] * n
    w = np.maximum(np.asarray(weights, dtype=float), 1.0)
    extra = total - n
    share = w / w.sum() * extra
    base = np.floor(share).astype(int)
    order = n - 1 - np.argsort(-(share - base)[::-1], kind="stable")   # ties go to later chunks
    base[order[:extra - int(base.sum())]] += 1
    return [1 + int(b) for b in base]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {SLO_KEYS}, got {item!r}")
        slos[key] = float(value)
        if slos[key] < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.latency}
    return all(values[k] * 1000.0 <= v for k, v in slos.items())


def _stats(name: str, values_s: list[float], percentiles) -> dict[str, float]:
    arr = np.asarray(values_s, dtype=float) * 1000.0 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def compute_metrics(results: list[RequestResult], duration: float, slos: dict[str, float] | None = None,
                    percentiles=DEFAULT_PERCENTILES) -> dict[str, float]:
    """The summary for one run (vLLM's key names; times in ms)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    duration = max(duration, 1e-9)
    m: dict[str, float] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    if slos:
        m["request_goodput"] = sum(meets_slos(r, slos) for r in ok) / duration
    m.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    m.update(_stats("tpot", [r.tpot for r in ok if r.tpot is not None], percentiles))
    m.update(_stats("itl", [g for r in ok for g in r.itl], percentiles))
    m.update(_stats("e2el", [r.latency for r in ok], percentiles))
    return m
