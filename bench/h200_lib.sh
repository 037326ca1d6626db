# Shared by the bench/h200_*.sh scripts (sourced): one throughput run per shape and placement.
bench() {  # shape placement batches...   (STEPS=n: timed steps per batch, 3 unless set)
    local shape=$1 p=$2; shift 2
    timeout 240 python3 bench/throughput.py --shape "$shape" --batch "$@" --seq 4096 --steps "${STEPS:-3}" --placement "$p" \
        --out "$OUT/bench.jsonl" --save-trace "$OUT/tr_$p" 2>&1 | tee -a "$OUT/steps.log" | grep -v "^  batch" | cut -c1-300
}
pack() {  # every tr_* trace folder under $OUT into one archive (at most 8 files come back from a call)
    tar czf "$OUT/traces.tgz" -C "$OUT" $(cd "$OUT" && ls -d tr_* 2>/dev/null)
}
