"""compare.py's figures -> ratios with targets, compare.json and the compare.md table."""

from __future__ import annotations

import json
import pathlib


def short(s: dict) -> str:
    return (f"{s['output_throughput']:.1f} out tok/s, TTFT mean {s['mean_ttft_ms']:.0f} ms, "
            f"TPOT mean {s['mean_tpot_ms']:.1f} ms, {s['completed']} ok")


def _ratio(name: str, value, target: float, op: str, detail: str, unit: str = "x") -> dict:
    ok = None if value is None else (value >= target if op == ">=" else value <= target)
    return {"name": name, "value": value, "target": target, "op": op, "unit": unit,
            "pass": ok, "higher_is_better": op == ">=", "detail": detail}


def ratios(f: dict) -> list[dict]:
    cl, ip = f["cluster"], f["inprocess"]
    tput = cl["output_throughput"]
    limit = f["matmul_gflops"]["64"] * 1e9 / (2 * f["params"])
    out = [
        _ratio("(a) vs HF generate, one at a time", tput / f["hf_one_at_a_time"]["output_throughput"], 6.0, ">=",
               f"{tput:.1f} vs {f['hf_one_at_a_time']['output_throughput']:.1f} out tok/s"),
        _ratio("(a) vs HF generate, padded static batch", tput / f["hf_static_batch"]["output_throughput"], 1.5,
               ">=", f"{tput:.1f} vs {f['hf_static_batch']['output_throughput']:.1f} out tok/s "
               f"(batch {f['hf_static_batch']['batch_size']})"),
        _ratio("(a') share of fp32 matmul limit", tput / limit, 0.60, ">=",
               f"{tput:.1f} tok/s x 2 x {f['params'] / 1e6:.1f} M params / {f['matmul_gflops']['64']:.0f} GFLOP/s "
               f"(limit {limit:.0f} tok/s)", unit="share"),
        _ratio("(b) gRPC cluster / in-process, throughput", tput / ip["output_throughput"], 0.92, ">=",
               f"{tput:.1f} vs {ip['output_throughput']:.1f} out tok/s"),
        _ratio("(b) gRPC cluster - in-process, mean TPOT", cl["mean_tpot_ms"] - ip["mean_tpot_ms"], 1.0, "<=",
               f"{cl['mean_tpot_ms']:.1f} vs {ip['mean_tpot_ms']:.1f} ms", unit="ms"),
        _ratio("(c) prefix cache off / on, mean TTFT", f["prefix_off"]["mean_ttft_ms"] / f["prefix_on"]["mean_ttft_ms"],
               5.0, ">=", f"{f['prefix_off']['mean_ttft_ms']:.0f} vs {f['prefix_on']['mean_ttft_ms']:.0f} ms "
               "(1024-token shared prefix, one request at a time)"),
        _ratio("(c) prefix cache on / off, throughput at 0% hits",
               f["misses_on"]["output_throughput"] / f["misses_off"]["output_throughput"], 0.99, ">=",
               f"{f['misses_on']['output_throughput']:.1f} vs {f['misses_off']['output_throughput']:.1f} out tok/s"),
    ]
    d, whole = f["chunked_default"], f["chunked_whole"]
    extra = f"; budget 256: {f['chunked_256']['p99_over_median']:.1f}x" if "chunked_256" in f else ""
    out.append(_ratio("(d) chunked prefill, p99 / median ITL (default budget)", d["p99_over_median"], 2.0, "<=",
                      f"p99 {d['p99_itl_ms']:.0f} / median {d['median_itl_ms']:.0f} ms; whole-prompt budget: "
                      f"{whole['p99_over_median']:.1f}x (p99 {whole['p99_itl_ms']:.0f} ms){extra}"))
    ll = f["llama_cpp"]
    if "skipped" in ll:
        out.append({**_ratio("(e) vs llama.cpp (llama-cpp-python)", None, 1.0, ">=", ll["skipped"]),
                    "pass": None})
    else:
        out.append(_ratio("(e) vs llama.cpp (llama-cpp-python)", tput / ll["output_throughput"], 1.0, ">=",
                          f"{tput:.1f} vs {ll['output_throughput']:.1f} out tok/s (llama.cpp one stream, Q4_1)"))
    return out


def _clean(f: dict) -> dict:
    return {k: ({kk: vv for kk, vv in v.items() if not kk.startswith("_")} if isinstance(v, dict) else v)
            for k, v in f.items()}


def write(out_dir: pathlib.Path, info: dict, w, figures: dict, rows: list[dict]) -> None:
    doc = {"machine": info, "workloads": vars(w), "ratios": rows, "figures": _clean(figures)}
    (out_dir / "compare.json").write_text(json.dumps(doc, indent=2, default=float))
    md = [f"# steploop compare ({'quick' if info['quick'] else 'full'} run)", "",
          (f"{info['date']} on {info['cpu']}, {info['cores']} cores, torch {info['torch']} "
           f"({info['torch_threads']} threads per engine), no GPU. Load average "
           f"{info['load_average_at_start'][0]:.1f} at start, {info['load_average_at_end'][0]:.1f} at end (other "
           "engineers' tests shared the machine, so absolute figures are low and noisy; ratios were measured back "
           f"to back). Wall time {info['wall_seconds']:.0f} s."),
          "", markdown_table(rows), "",
          ("Plots: `compare-throughput.png`, `compare-ratios.png`, `compare-ttft-itl.png` (cluster vs in-process), "
           "`compare-chunked-prefill.png`. Raw figures: `compare.json`. Re-run: `python benchmarks/compare.py` "
           "(`--quick` for a smoke run).")]
    (out_dir / "compare.md").write_text("\n".join(md) + "\n")


def markdown_table(rows: list[dict]) -> str:
    lines = ["| comparison | measured | target | result | detail |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        value = "—" if r["value"] is None else (
            f"{r['value']:.0%}" if r["unit"] == "share" else f"{r['value']:+.2f} ms" if r["unit"] == "ms"
            else f"{r['value']:.2f}x")
        target = f"{r['op']} " + (f"{r['target']:.0%}" if r["unit"] == "share" else
                                  f"+{r['target']:g} ms" if r["unit"] == "ms" else f"{r['target']:g}x")
        result = "skipped" if r["pass"] is None else "pass" if r["pass"] else "FAIL"
        lines.append(f"| {r['name']} | {value} | {target} | {result} | {r['detail']} |")
    return "\n".join(lines)
