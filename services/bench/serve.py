"""`steploop bench serve`: load-test any OpenAI-compatible server and report vLLM's `bench serve` figures.

    steploop bench serve --base-url http://127.0.0.1:8000 --dataset random --random-input-len 256 \\
        --random-output-len 64 --num-prompts 64 --request-rate 1,2,4 --goodput ttft:500 tpot:100

Several --request-rate values run one after another; the JSON holds one summary per rate, and a plot of latency
against throughput is drawn across them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

from steploop.bench import datasets, plots, runner
from steploop.bench.client import Target
from steploop.bench.metrics import parse_goodput


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steploop bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--model", default=None, help="model name to send (default: first of GET /v1/models)")
    g.add_argument("--tokenizer", default=None,
                   help="model folder for the tokenizer (default: --model via resolve_model, else words)")
    g.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--api-key", default=None)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (output lengths are then not exact)")
    g.add_argument("--send-token-ids", action="store_true",
                   help="send prompts as token-id lists (/v1/completions only): exact prompt lengths")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", default="random", choices=["random", "shared-prefix", "jsonl"])
    g.add_argument("--dataset-path", default=None, help="jsonl file: {\"prompt\": ..., \"output_len\": n} per line")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--num-warmups", type=int, default=0, help="extra requests sent first, one at a time, unmeasured")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--num-prefixes", type=int, default=1)
    g.add_argument("--suffixes-per-prefix", type=int, default=None, help="default: num_prompts / num_prefixes")
    g.add_argument("--prefix-len", type=int, default=1024)
    g.add_argument("--suffix-len", type=int, default=32)
    g.add_argument("--output-len", type=int, default=128, help="shared-prefix / jsonl default output length")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default="inf", help="requests/s, comma-separated for a sweep (inf = all now)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:100")
    g.add_argument("--metric-percentiles", default="50,90,99")
    g.add_argument("--disable-tqdm", action="store_true")
    g = p.add_argument_group("output")
    g.add_argument("--result-dir", default=None, help="write JSON (and PNG plots) here")
    g.add_argument("--result-filename", default=None, help="default: bench-<dataset>-<date>.json")
    g.add_argument("--save-detailed", action="store_true", help="per-request TTFT/ITL/lengths in the JSON")
    g.add_argument("--no-plots", action="store_true")
    return p


def make_dataset(args, tokenizer) -> tuple[list, list]:
    """(measured, warm-up) requests; warm-ups are extra samples from the same generator."""
    n = args.num_prompts + args.num_warmups
    as_ids = args.send_token_ids
    if args.dataset == "random":
        reqs = datasets.random_dataset(n, args.random_input_len, args.random_output_len, args.random_range_ratio,
                                       tokenizer, args.seed, as_ids)
    elif args.dataset == "shared-prefix":
        m = args.suffixes_per_prefix or max(1, -(-n // args.num_prefixes))
        reqs = datasets.shared_prefix_dataset(args.num_prefixes, m, args.prefix_len, args.suffix_len,
                                              args.output_len, tokenizer, args.seed, as_ids)
    else:
        if not args.dataset_path:
            raise SystemExit("steploop bench serve: --dataset jsonl needs --dataset-path FILE")
        reqs = datasets.jsonl_dataset(args.dataset_path, tokenizer, args.output_len)
    warm, measured = reqs[:args.num_warmups], reqs[args.num_warmups:args.num_warmups + args.num_prompts]
    return measured, warm


async def _default_model(base_url: str, api_key: str | None) -> str:
    import aiohttp
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(trust_env=False) as s, s.get(base_url.rstrip("/") + "/v1/models",
                                                                  headers=headers) as r:
        return (await r.json())["data"][0]["id"]


def parse_rates(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


async def bench(args) -> dict:
    model = args.model or await _default_model(args.base_url, args.api_key)
    tokenizer = datasets.load_tokenizer(args.tokenizer or model)
    if args.send_token_ids and "chat" in args.endpoint:
        raise SystemExit("steploop bench serve: --send-token-ids works with /v1/completions only")
    measured, warm = make_dataset(args, tokenizer)
    target = Target(args.base_url, model, args.endpoint, args.api_key, args.ignore_eos)
    slos = parse_goodput(args.goodput)
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "base_url": args.base_url,
           "model": model, "endpoint": args.endpoint, "dataset": args.dataset, "num_prompts": len(measured),
           "seed": args.seed, "slos_ms": slos, "runs": []}
    raw = []
    for i, rate in enumerate(parse_rates(args.request_rate)):
        summary, results = await runner.run(
            target, measured, request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
            warmups=warm if i == 0 else (), seed=args.seed, tokenizer=tokenizer, slos=slos,
            percentiles=percentiles, progress=not args.disable_tqdm)
        if args.save_detailed:
            summary["requests"] = [{"prompt_len": r.prompt_len, "output_tokens": r.output_tokens, "ttft": r.ttft,
                                    "latency": r.latency, "itl": r.itl, "error": r.error} for r in results]
        out["runs"].append(summary)
        raw.append((f"rate {rate:g}/s", results))
        print_summary(summary)
    if args.result_dir:
        write_results(args, out, raw)
    return out


def write_results(args, out: dict, raw: list) -> None:
    folder = pathlib.Path(args.result_dir)
    folder.mkdir(parents=True, exist_ok=True)
    name = args.result_filename or f"bench-{args.dataset}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    path = folder / name
    path.write_text(json.dumps(out, indent=2))
    print(f"results: {path}")
    if not args.no_plots:
        stem = path.with_suffix("")
        made = [plots.plot_distributions(raw, stem.with_name(stem.name + "-ttft-itl.png")),
                plots.plot_rate_sweep(out["runs"], stem.with_name(stem.name + "-rates.png"))]
        if made[0] is None:
            print("plots skipped: install matplotlib (pip install 'steploop[bench]')")
        for p in filter(None, made):
            print(f"plot: {p}")


def print_summary(s: dict) -> None:
    rows = [("request rate (req/s)", s["request_rate"]), ("max concurrency", s["max_concurrency"]),
            ("duration (s)", s["duration"]), ("completed / failed", f"{s['completed']} / {s['failed']}"),
            ("input / output tokens", f"{s['total_input_tokens']} / {s['total_output_tokens']}"),
            ("request throughput (req/s)", s["request_throughput"]),
            ("output throughput (tok/s)", s["output_throughput"]),
            ("total token throughput (tok/s)", s["total_token_throughput"])]
    if "request_goodput" in s:
        rows.append(("request goodput (req/s)", s["request_goodput"]))
    for name in ("ttft", "tpot", "itl", "e2el"):
        rows.append((f"{name.upper()} mean / median / p99 (ms)",
                     f"{s[f'mean_{name}_ms']:.2f} / {s[f'median_{name}_ms']:.2f} / {s.get(f'p99_{name}_ms', 0):.2f}"))
    print("=" * 64)
    for k, v in rows:
        print(f"{k:<40}{v:>24.2f}" if isinstance(v, float) else f"{k:<40}{v!s:>24}")
    for e in s.get("errors", []):
        print(f"error: {e}", file=sys.stderr)
    print("=" * 64)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1:
        raise SystemExit("steploop bench serve: --num-prompts must be >= 1")
    runner.run_sync(bench(args))
