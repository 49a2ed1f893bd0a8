"""A GGUF file served by `steploop serve --model FILE.gguf` (gateway, scheduler, worker: the real cluster, on the
CPU), one chat/completions request answered, and the worker's peak resident size (VmHWM) set against the file's
size plus its KV cache (the size the worker logs) plus a margin (issue 32: 1.5 GiB):
    python -m benchmarks.gguf_serve_memory [--shape 8b] [--file F.gguf] [--out /work/scratch/models]
        [--margin-gib 1.5] [-- SERVE ARGS...]

The file is gguf_shapes.py's Q4_K_M-like one of the shape (written on first use, tensor by tensor) unless --file is
given. Reports file size, KV cache, weights in memory (the worker's log line), the worker's peak and the margin left;
writes benchmarks/results/gguf_serve_memory_<shape>.json with the machine. Exit code 1 when the peak is over.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from benchmarks.gguf_shapes import SHAPES, ensure_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = pathlib.Path(__file__).parent / "results"
KV_LINE = re.compile(r"KV cache: .* ([\d.]+) GiB in all")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_kib(pid: int, field: str) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def worker_pid(root: int) -> int | None:
    """The steploop.gpu_worker process among `root`'s descendants."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        try:
            if b"steploop.gpu_worker" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
        todo += children.get(pid, [])
    return None


def http(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_for(condition, proc: subprocess.Popen, timeout: float, what: str, log: pathlib.Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        if condition():
            return
        time.sleep(0.5)       # a poll interval
    raise TimeoutError(f"{what} after {timeout} s:\n{log.read_text()[-4000:]}")


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def serve_and_measure(path: pathlib.Path, log: pathlib.Path, serve_args: list[str], timeout: float,
                      max_tokens: int, ports: tuple[int, int]) -> dict:
    port, scheduler_port = ports
    argv = [sys.executable, "-m", "steploop.cli", "serve", "--model", str(path), "--port", str(port),
            "--scheduler-port", str(scheduler_port), "--metrics-port", "0", *serve_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    base = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    started = time.monotonic()
    try:
        wait_for(lambda: healthy(base), proc, timeout, "serve not ready", log)
        ready_s = time.monotonic() - started
        pid = worker_pid(proc.pid)
        if pid is None:
            raise RuntimeError("no steploop.gpu_worker process under serve")
        model = http(base + "/v1/models")["data"][0]["id"]
        t0 = time.monotonic()
        reply = http(base + "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        request_s = time.monotonic() - t0
        peak_kib, rss_kib = status_kib(pid, "VmHWM"), status_kib(pid, "VmRSS")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text(errors="replace")
    kv = KV_LINE.search(text)
    weights = re.search(r"GGUF weights in memory: [^;]*", text)
    return {"ready_seconds": round(ready_s, 1), "request_seconds": round(request_s, 1),
            "completion_tokens": reply["usage"]["completion_tokens"],
            "kv_cache_gib": float(kv.group(1)) if kv else None, "weights_in_memory": weights and weights.group(0),
            "worker_peak_rss_gib": round(peak_kib / 2**20, 3), "worker_rss_after_gib": round(rss_kib / 2**20, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--file", type=pathlib.Path, default=None, help="serve this GGUF instead of the shape's")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/gguf-serve-memory"))
    parser.add_argument("--margin-gib", type=float, default=1.5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ready-timeout", type=float, default=1200)
    parser.add_argument("--ports", type=int, nargs=2, default=None, metavar=("HTTP", "GRPC"),
                        help="the gateway's and scheduler's ports (default: free ones)")
    parser.add_argument("serve_args", nargs="*", help="after --: more `steploop serve` flags")
    args = parser.parse_args(argv)
    path = args.file or ensure_file(args.out, SHAPES[args.shape])
    args.out.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    result = serve_and_measure(path, args.out / "serve.log", args.serve_args, args.ready_timeout, args.max_tokens,
                                args.ports or (free_port(), free_port()))
    file_gib = path.stat().st_size / 2**30
    bound = file_gib + (result["kv_cache_gib"] or 0) + args.margin_gib
    result.update({"file": path.name, "file_gib": round(file_gib, 3), "bound_gib": round(bound, 3),
                   "margin_left_gib": round(bound - result["worker_peak_rss_gib"], 3),
                   "load_avg_start_end": [load_start, os.getloadavg()]})
    print(json.dumps(result, indent=2))
    from benchmarks.machine import machine_info
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"gguf_serve_memory_{args.shape if args.file is None else path.stem}.json"
    out.write_text(json.dumps({"machine": machine_info(), "serve_args": args.serve_args, **result}, indent=2) + "\n")
    return 0 if result["worker_peak_rss_gib"] <= bound else 1


if __name__ == "__main__":
    raise SystemExit(main())
