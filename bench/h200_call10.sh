#!/usr/bin/env bash
# 2026-12-01 (third session): issue 11's 256K and 512K rows with default settings, one detached process
# (~13 minutes: 7B init ~80 s, 256K ~145 s, 512K ~540 s by the planner), across two device calls:
#   PYTHONPATH=$PWD bash bench/h200_call10.sh start   # launches it (setsid: it outlives the call), runs the
#                                                      # exact-pinning GPU test beside its init, then waits
#   PYTHONPATH=$PWD bash bench/h200_call10.sh wait    # the next call, within the 30 s the machine stays warm
# Each call waits until the process ends or --until seconds pass, then copies its rows and logs to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
D=/tmp/long; mkdir -p "$D"
until_s=${2:-540}
. bench/h200_lib.sh
if [ "${1:-wait}" = start ]; then
    detached_start "$D" python3 bench/long_context.py --seq 256k 512k --steps 1 --out "$D/long_context.jsonl" \
        --save-trace "$D/tr"
    timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_longcontext.py -rA 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -3
fi
detached_wait "$D" "$until_s"
