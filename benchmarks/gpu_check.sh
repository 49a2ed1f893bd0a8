#!/usr/bin/env bash
# The GPU check: benchmarks/gpu_readiness.py (kernels vs references, end to end vs transformers, decode against the
# bandwidth bound), written to $OUT/readiness.json (or benchmarks/results/), then the tensor-parallel check on hosts
# with 2+ GPUs. Usage (repo root, stubs carried: benchmarks/GPU_READINESS.md):  bash benchmarks/gpu_check.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT_DIR="${OUT:-benchmarks/results}"
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT_DIR/nvidia_smi.csv" 2>&1 || true
# each section has its own timeout inside; this guard only catches a hung parent
timeout 480 "$PY" -m benchmarks.gpu_readiness --out "$OUT_DIR" "$@"
rc=$?
[ $rc -eq 124 ] && echo "[gpu_check] stopped by the 480 s guard; partial JSON kept" >&2
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if [ "${TP_CHECK:-1}" = 0 ]; then
  echo "[gpu_check] TP=2 run skipped (TP_CHECK=0)"
elif [ "$gpus" -lt 2 ]; then
  echo "[gpu_check] TP=2 run skipped: it needs 2 GPUs, this host has $gpus"
else
  timeout 240 "$PY" -m benchmarks.tp_gpu_check --world-size 2 || rc=$((rc ? rc : $?))
fi
exit $rc
