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
if [ "${1:-wait}" = start ]; then
    setsid nohup python3 bench/long_context.py --seq 256k 512k --steps 1 --out "$D/long_context.jsonl" \
        --save-trace "$D/tr" > "$D/long_rows.log" 2>&1 < /dev/null &
    echo $! > "$D/pid"
    setsid nohup bash -c "while sleep 5; do echo \$(date +%s) \$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits) \
        \$(free -m | awk '/Mem:/{print \$3, \$7}'); done" > "$D/mem.log" 2>&1 < /dev/null &
    timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_longcontext.py -rA 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -3
fi
t0=$(date +%s)
while kill -0 "$(cat $D/pid)" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$until_s" ]; do sleep 5; done
kill -0 "$(cat $D/pid)" 2>/dev/null && echo "still running after $(( $(date +%s) - t0 )) s" || echo "process ended"
cp "$D"/long_context.jsonl "$D"/long_rows.log "$D"/mem.log "$OUT"/ 2>/dev/null
[ -d "$D/tr" ] && tar czf "$OUT/traces.tgz" -C "$D" tr
grep -v "^{" "$D/long_rows.log" | tail -5 | cut -c1-400
cut -c1-700 "$D/long_context.jsonl" 2>/dev/null
tail -2 "$D/mem.log"
