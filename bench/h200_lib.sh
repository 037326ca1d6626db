# Shared by the bench/h200_*.sh scripts (sourced): one throughput run per shape and placement.
bench() {  # shape placement batches...   (STEPS=n: timed steps per batch, 3 unless set)
    local shape=$1 p=$2; shift 2
    timeout 240 python3 bench/throughput.py --shape "$shape" --batch "$@" --seq 4096 --steps "${STEPS:-3}" --placement "$p" \
        --out "$OUT/bench.jsonl" --save-trace "$OUT/tr_$p" 2>&1 | tee -a "$OUT/steps.log" | grep -v "^  batch" | cut -c1-300
}
pack() {  # every tr_* trace folder under $OUT into one archive (at most 8 files come back from a call)
    tar czf "$OUT/traces.tgz" -C "$OUT" $(cd "$OUT" && ls -d tr_* 2>/dev/null)
}
detached_start() {  # D CMD...: run CMD (its output in D/long_rows.log) outliving the call, with D/mem.log sampling memory
    local D=$1; shift
    setsid nohup "$@" > "$D/long_rows.log" 2>&1 < /dev/null &
    echo $! > "$D/pid"
    setsid nohup bash -c "while sleep 5; do echo \$(date +%s) \$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits) \
        \$(free -m | awk '/Mem:/{print \$3, \$7}'); done" > "$D/mem.log" 2>&1 < /dev/null &
}
detached_wait() {  # D UNTIL: wait for D's process (at most UNTIL s), then copy its rows, logs and traces to $OUT
    local D=$1 t0; t0=$(date +%s)
    while kill -0 "$(cat "$D/pid")" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$2" ]; do sleep 5; done
    kill -0 "$(cat "$D/pid")" 2>/dev/null && echo "still running after $(( $(date +%s) - t0 )) s" || echo "process ended"
    cp "$D"/long_context.jsonl "$D"/long_rows.log "$D"/mem.log "$D"/gpu_tests.log "$OUT"/ 2>/dev/null
    [ -d "$D/tr" ] && tar czf "$OUT/traces.tgz" -C "$D" tr
    grep -v "^{" "$D/long_rows.log" | tail -5 | cut -c1-400
    cut -c1-900 "$D/long_context.jsonl" 2>/dev/null
    tail -2 "$D/mem.log"
}
