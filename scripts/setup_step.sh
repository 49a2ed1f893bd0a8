#!/bin/sh
# scripts/setup_step.sh LABEL COMMAND [ARG...]: one set-up step of `make install`, between a line saying what
# it is and one saying how long it took, so a first set-up (minutes) is never silent about where it is.
label=$1
shift
echo "==> $label"
start=$(date +%s)
"$@"
status=$?
if [ "$status" -ne 0 ]; then
    echo "==> $label: FAILED (exit $status) after $(( $(date +%s) - start )) s"
    exit "$status"
fi
echo "==> $label: done in $(( $(date +%s) - start )) s"
