#!/usr/bin/env bash
# The one prepared GPU check: kernel tests compiled on CUDA, attention bandwidth, end-to-end tokens/s.
# Usage (repo root, venv carried, no network needed):  bash benchmarks/gpu_check.sh [extra gpu_check.py args]
# Writes benchmarks/results/gpu_check.json after every section (partial results survive a timeout).
# Budget: < 5 minutes in all (tests 150 s, then bandwidth/attention/e2e), each step under `timeout`.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
mkdir -p benchmarks/results
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > benchmarks/results/gpu_check_nvidia_smi.csv 2>&1 || true
# the AOT compile test already runs on CPU machines; on the GPU the kernel tests run compiled for real
timeout 290 "$PY" -m benchmarks.gpu_check --tests-timeout 150 "$@"
rc=$?
[ $rc -eq 124 ] && echo "[gpu_check] stopped by the 290 s guard; partial JSON kept" >&2
# Tensor parallel: a -tp 2 group (NCCL) against transformers, on a host with two GPUs (TP_CHECK=0 skips it).
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if [ "${TP_CHECK:-1}" = 0 ]; then
  echo "[gpu_check] TP=2 run skipped (TP_CHECK=0)"
elif [ "$gpus" -lt 2 ]; then
  echo "[gpu_check] TP=2 run skipped: it needs 2 GPUs, this host has $gpus"
else
  timeout 240 "$PY" -m benchmarks.tp_gpu_check --world-size 2 || rc=$((rc ? rc : $?))
fi
exit $rc
