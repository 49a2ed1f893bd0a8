"""compare.py's figures -> ratios with targets, compare.json and the compare.md table."""

from __future__ import annotations

import json
import pathlib
from statistics import median


def short(s: dict) -> str:
    return (f"{s['output_throughput']:.1f} out tok/s, TTFT mean {s['mean_ttft_ms']:.0f} ms, "
            f"TPOT mean {s['mean_tpot_ms']:.1f} ms, {s['completed']} ok")


def _ratio(key: str, name: str, value, target: float | None, op: str, detail: str, unit: str = "x") -> dict:
    """One row. target None: informational (no pass/fail)."""
    ok = None if value is None or target is None else (value >= target if op == ">=" else value <= target)
    return {"key": key, "name": name, "value": value, "target": target, "op": op, "unit": unit,
            "pass": ok, "higher_is_better": op == ">=", "detail": detail}


def ratios(f: dict) -> list[dict]:
    cl, ip = f["cluster"], f["inprocess"]
    tput = cl["output_throughput"]
    limit = f["matmul_gflops"]["64"] * 1e9 / (2 * f["params"])
    load = f"{cl['completed']} requests, at most {cl.get('max_concurrency') or cl['completed']} in flight"
    st = f["hf_static_batch"]
    out = [
        _ratio("a_one_at_a_time", "(a) vs HF generate, one at a time",
               tput / f["hf_one_at_a_time"]["output_throughput"], 6.0, ">=",
               f"{tput:.1f} vs {f['hf_one_at_a_time']['output_throughput']:.1f} out tok/s (steploop: {load}; HF: "
               f"{f['hf_one_at_a_time']['requests']} of them, one at a time)"),
        _ratio("a_static_batch", "(a) vs HF generate, padded static batch", tput / st["output_throughput"], 1.5,
               ">=", f"{tput:.1f} vs {st['output_throughput']:.1f} out tok/s (HF: the same {st['requests']} "
               f"requests in {str(st['batches']) + ' ' if 'batches' in st else ''}padded batches of "
               f"{st['batch_size']})"),
        _ratio("a_share_of_limit", "(a') share of fp32 matmul limit", tput / limit, 0.60, ">=",
               f"{tput:.1f} tok/s x 2 x {f['params'] / 1e6:.1f} M params / {f['matmul_gflops']['64']:.0f} GFLOP/s "
               f"(limit {limit:.0f} tok/s{_limit_runs(f)})", unit="share"),
    ]
    if "packed_gflops" in f:
        packed_limit = f["packed_gflops"]["64"] * 1e9 / (2 * f["params"])
        out.append(_ratio("a_share_of_packed_limit", "(a') informational: share of the packed kernel's rate",
                          tput / packed_limit, None, ">=",
                          f"the worker multiplies by the same fp32 weights read from their packed Q4_1/Q8_0 form: "
                          f"{f['packed_gflops']['64']:.0f} GFLOP/s on the same shapes (limit {packed_limit:.0f} "
                          f"tok/s)", unit="share"))
    out += [
        _ratio("b_throughput", "(b) gRPC cluster / in-process, throughput", tput / ip["output_throughput"], 0.92,
               ">=", f"{tput:.1f} vs {ip['output_throughput']:.1f} out tok/s ({load}, both{_rounds(f, 'cluster')})"),
        _tpot_row(f),
        _ratio("c_prefix_ttft", "(c) prefix cache off / on, mean TTFT",
               f["prefix_off"]["mean_ttft_ms"] / f["prefix_on"]["mean_ttft_ms"], 5.0, ">=",
               f"{f['prefix_off']['mean_ttft_ms']:.0f} vs {f['prefix_on']['mean_ttft_ms']:.0f} ms "
               "(1024-token shared prefix, one request at a time)"),
        _ratio("c_miss_throughput", "(c) prefix cache on / off, throughput at 0% hits",
               f["misses_on"]["output_throughput"] / f["misses_off"]["output_throughput"], 0.99, ">=",
               f"{f['misses_on']['output_throughput']:.1f} vs {f['misses_off']['output_throughput']:.1f} out tok/s"
               f"{_rounds(f, 'misses_on')}"),
    ]
    d, whole = f["chunked_default"], f["chunked_whole"]
    extra = (f"; budget 256 alone: {f['chunked_256']['p99_over_median']:.1f}x" if "chunked_256" in f else "")
    out.append(_ratio("d_p99_over_median", "(d) chunked prefill, p99 / median ITL (default flags)",
                      d["p99_over_median"], 2.0, "<=",
                      f"p99 {d['p99_itl_ms']:.0f} / median {d['median_itl_ms']:.0f} ms (prefill pacing on"
                      f"{_window(d)}); without pacing, "
                      f"whole-prompt budget: "
                      f"{whole['p99_over_median']:.1f}x (p99 {whole['p99_itl_ms']:.0f} ms){extra}"))
    out += _llama_cpp_rows(f)
    return out


def _limit_runs(f: dict) -> str:
    """'; the better of a and b GFLOP/s, ...' when the limit was measured at both ends of the run."""
    runs = [run["64"] for run in f.get("matmul_gflops_runs", [])]
    if len(runs) < 2:
        return ""
    return f"; the better of {' and '.join(f'{r:.0f}' for r in runs)} GFLOP/s, measured first and last"


def _rounds(f: dict, key: str) -> str:
    """'; best of alternating rounds: a, b vs c, d' when the run alternated rounds (older results did not)."""
    other = {"cluster": "inprocess", "misses_on": "misses_off", "cluster_16": "llama_cpp_16"}[key]
    r = f.get("rounds", {})
    if len(r.get(key, [])) < 2:
        return ""
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
    return (f"; best of alternating rounds: {fmt(r[key])} vs {fmt(r[other])} (medians {median(r[key]):.1f} vs "
            f"{median(r[other]):.1f}: {median(r[key]) / median(r[other]):.2f}x)")


def _tpot_row(f: dict) -> dict:
    """(b)'s TPOT cost: with alternating rounds, the mean of the back-to-back differences (one engine's TPOT moves
    5-15 ms between rounds on a shared host, so one pair, or the best-throughput rounds, cannot resolve 1 ms);
    with one round, that round's difference. The detail lists every round and the paired mean's standard error."""
    cl, ip = f["cluster"], f["inprocess"]
    best = f"the best-throughput rounds {cl['mean_tpot_ms']:.1f} vs {ip['mean_tpot_ms']:.1f} ms"
    r = f.get("rounds_tpot_ms", {})
    rc, ri = r.get("cluster", []), r.get("inprocess", [])
    if len(rc) < 2 or len(rc) != len(ri):
        return _ratio("b_tpot", "(b) gRPC cluster - in-process, mean TPOT", cl["mean_tpot_ms"] - ip["mean_tpot_ms"],
                      1.0, "<=", best, unit="ms")
    diffs = [a - b for a, b in zip(rc, ri)]
    mean = sum(diffs) / len(diffs)
    se = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)) ** 0.5
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
    return _ratio("b_tpot", "(b) gRPC cluster - in-process, mean TPOT", mean, 1.0, "<=",
                  f"mean of {len(diffs)} back-to-back round differences ({fmt(diffs)} ms), standard error "
                  f"{se:.1f} ms; per round {fmt(rc)} vs {fmt(ri)} ms; {best}", unit="ms")


def _window(d: dict) -> str:
    if "window_tokens" not in d:
        return ""
    return (f"; {d['window_tokens']} stream tokens in the {d['window_s']:.1f} s while the long prompts arrived; "
            f"whole run p99 {d['whole_run_p99_itl_ms']:.0f} / median {d['whole_run_median_itl_ms']:.0f} ms")


def _llama_cpp_rows(f: dict) -> list[dict]:
    many, one = f.get("llama_cpp_16", {"skipped": "not measured"}), f["llama_cpp"]
    name = "(e) vs llama.cpp (llama-cpp-python), 16 concurrent streams"
    if "skipped" in many:
        return [_ratio("e_llama_cpp_16_streams", name, None, 2.0, ">=", many["skipped"])]
    ours = f["cluster_16"]["output_throughput"]
    rows = [_ratio("e_llama_cpp_16_streams", name, ours / many["output_throughput"], 2.0, ">=",
                   f"{ours:.1f} vs {many['output_throughput']:.1f} out tok/s: the same {many['requests']} requests, "
                   f"at most {many['streams']} in flight in both (steploop gRPC cluster fp32; llama.cpp's "
                   f"multi-sequence batching, {many['weights']}, {many['threads']} threads); mean TPOT "
                   f"{f['cluster_16']['mean_tpot_ms']:.0f} vs {many['mean_tpot_ms']:.0f} ms{_rounds(f, 'cluster_16')}")]
    if "output_throughput" in one:
        rows.append(_ratio("e_llama_cpp_one_stream", "(e) informational: vs llama.cpp one stream at a time",
                           ours / one["output_throughput"], None, ">=",
                           f"steploop 16 streams {ours:.1f} vs llama.cpp one stream {one['output_throughput']:.1f} "
                           f"out tok/s ({one['requests']} of the requests, one at a time; llama.cpp's own 16-stream "
                           f"batching is {many['output_throughput'] / one['output_throughput']:.2f}x its one stream)"))
    return rows


def targets(rows: list[dict]) -> dict:
    """{key: {measured, target, op, pass}} for every row, the informational ones with target None."""
    return {r.get("key", r["name"]): {"name": r["name"], "measured": r["value"], "target": r["target"], "op": r["op"],
                       "unit": r["unit"], "pass": r["pass"]} for r in rows}


def machine_line(info: dict) -> str:
    """What the machine was, in one sentence (compare.json's "machine" has the fields)."""
    parts = [f"{info['cpu']}, {info['cores']} cores"]
    if info.get("simd"):
        parts.append("/".join(info["simd"]))
    if info.get("memory_gib"):
        parts.append(f"{info['memory_gib']:.0f} GiB RAM")
    if info.get("os"):
        parts.append(info["os"])
    parts.append(f"GPU: {info['gpu']} (not used)" if info.get("gpu") else "no GPU")
    versions = [f"torch {info['torch']}"] + [f"{k.replace('_', '-')} {info[k]}" for k in ("transformers",
                                                                                          "llama_cpp_python")
                                            if info.get(k)]
    threads = info.get("engine_threads", info["torch_threads"])
    commit = f"commit {info['commit']}; " if info.get("commit") else ""
    return (f"{commit}{', '.join(parts)}; {', '.join(versions)}, Python {info['python']}; {threads} threads per "
            "engine (gRPC worker, in-process engine, transformers and llama.cpp alike)")


def _clean(f: dict) -> dict:
    return {k: ({kk: vv for kk, vv in v.items() if not kk.startswith("_")} if isinstance(v, dict) else v)
            for k, v in f.items()}


def write(out_dir: pathlib.Path, info: dict, w, figures: dict, rows: list[dict]) -> None:
    doc = {"machine": info, "workloads": vars(w), "targets": targets(rows), "ratios": rows,
           "figures": _clean(figures)}
    (out_dir / "compare.json").write_text(json.dumps(doc, indent=2, default=float))
    md = [f"# steploop compare ({'quick' if info['quick'] else 'full'} run)", "",
          f"Machine: {machine_line(info)}.", "",
          (f"Run {info['date']}. Load average {info['load_average_at_start'][0]:.1f} at start, "
           f"{info['load_average_at_end'][0]:.1f} at end (other engineers' tests shared the machine, so absolute "
           f"figures are low and noisy; ratios were measured back to back). Wall time {info['wall_seconds']:.0f} s."),
          "", workload_text(w), "", markdown_table(rows), "",
          ("Plots: `compare-throughput.png`, `compare-ratios.png`, `compare-ttft-itl.png` (cluster vs in-process), "
           "`compare-chunked-prefill.png`. Raw figures: `compare.json`. Re-run: `python benchmarks/compare.py` "
           "(`--quick` for a smoke run).")]
    (out_dir / "compare.md").write_text("\n".join(md) + "\n")


def workload_text(w) -> str:
    """The (a)/(b)/(e) workloads as run (w: compare.Workloads, or its vars from compare.json)."""
    requests = getattr(w, "requests", w.concurrency)
    lo, hi = round(w.output_len * (1 - w.range_ratio)), round(w.output_len * (1 + w.range_ratio))
    text = (f"Workload (a), (a'), (b): {requests} requests of mixed lengths (prompts ~{w.input_len} tokens, outputs "
            f"{lo}-{hi}, mean {w.output_len}; greedy, EOS ignored), at most {w.concurrency} in flight: a closed loop "
            "in which a new request starts as one finishes (the bench client's --max-concurrency for the cluster, "
            "InProcessEngine.run(max_concurrency=...) for the in-process engine). transformers `generate` (fp32) "
            f"runs the same {requests} requests as padded static batches of {w.hf_batch}, and {w.hf_single} of them "
            "one at a time.")
    if hasattr(w, "llama_streams"):
        text += (f" Workload (e): {w.llama_requests} requests (prompts ~{w.llama_input_len} tokens, outputs mean "
                 f"{w.llama_output_len}), at most {w.llama_streams} in flight, through the steploop cluster and "
                 f"through llama.cpp's batched decoding of {w.llama_streams} sequences (llama-cpp-python low-level "
                 f"API, Q4_1 GGUF); {w.llama_single} of them through llama.cpp one stream at a time.")
    return text


def markdown_table(rows: list[dict]) -> str:
    lines = ["| comparison | measured | target | result | detail |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        value = "—" if r["value"] is None else (
            f"{r['value']:.0%}" if r["unit"] == "share" else f"{r['value']:+.2f} ms" if r["unit"] == "ms"
            else f"{r['value']:.2f}x")
        target = "—" if r["target"] is None else f"{r['op']} " + (
            f"{r['target']:.0%}" if r["unit"] == "share" else
            f"+{r['target']:g} ms" if r["unit"] == "ms" else f"{r['target']:g}x")
        result = ("info" if r["target"] is None else "skipped" if r["value"] is None
                  else "pass" if r["pass"] else "FAIL")
        lines.append(f"| {r['name']} | {value} | {target} | {result} | {r['detail']} |")
    return "\n".join(lines)
