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
    if [ "$1" = start ]; then
        setsid nohup python3 bench/long_context.py --seq 512k --steps 1 --out "$D/long_context.jsonl" \
            --save-trace "$D/tr" > "$D/long_rows.log" 2>&1 < /dev/null &
        echo $! > "$D/pid"
        setsid nohup bash -c "while sleep 5; do echo \$(date +%s) \$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits) \
            \$(free -m | awk '/Mem:/{print \$3, \$7}'); done" > "$D/mem.log" 2>&1 < /dev/null &
    fi
    t0=$(date +%s)
    while kill -0 "$(cat $D/pid)" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "${2:-540}" ]; do sleep 5; done
    kill -0 "$(cat $D/pid)" 2>/dev/null && echo "still running after $(( $(date +%s) - t0 )) s" || echo "process ended"
    cp "$D"/long_context.jsonl "$D"/long_rows.log "$D"/mem.log "$OUT"/ 2>/dev/null
    [ -d "$D/tr" ] && tar czf "$OUT/traces.tgz" -C "$D" tr
    grep -v "^{" "$D/long_rows.log" | tail -5 | cut -c1-400
    cut -c1-900 "$D/long_context.jsonl" 2>/dev/null
    tail -2 "$D/mem.log" ;;
esac
