#!/usr/bin/env bash
# 2026-12-01 (fourth session): issue 11 with the attention cache (attncache.py), default settings.
#   check: the GPU tests of the cache, tiling and placement of checkpoints, then one process with the
#          32K (2 steps), 128K and 256K rows, traced (~6 minutes: 7B init ~80 s, 256K ~125 s by the planner).
#   start / wait: 512K alone, detached (setsid: it outlives the call), across two device calls:
#     PYTHONPATH=$PWD bash bench/h200_s4.sh start 540   then, within 30 s of its return,
#     PYTHONPATH=$PWD bash bench/h200_s4.sh wait 560
#   Each waits until the process ends or the given seconds pass, then copies rows, logs and traces to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
D=/tmp/long; mkdir -p "$D"
case "${1:-check}" in
check)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_attncache.py \
        tests/test_longcontext.py tests/test_tiling.py -rA 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed"
    timeout 420 python3 bench/long_context.py --seq 32k 128k 256k --steps 2 1 1 --out "$OUT/long_context.jsonl" \
        --save-trace "$OUT/tr_long" 2>&1 | tee "$OUT/long_rows.log" | grep -v "^{" | tail -6 | cut -c1-300
    cut -c1-900 "$OUT/long_context.jsonl"
    tar czf "$OUT/traces.tgz" -C "$OUT" tr_long && rm -rf "$OUT/tr_long" ;;
start|wait)
    . bench/h200_lib.sh
    [ "$1" = start ] && detached_start "$D" python3 bench/long_context.py --seq 512k --steps 1 \
        --out "$D/long_context.jsonl" --save-trace "$D/tr"
    detached_wait "$D" "${2:-540}" ;;
esac
