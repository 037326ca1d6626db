# Shared by the bench/h200_*.sh scripts (sourced): one throughput run per shape and placement.
bench() {  # shape placement batches...
    local shape=$1 p=$2; shift 2
    timeout 240 python3 bench/throughput.py --shape "$shape" --batch "$@" --seq 4096 --steps 3 --placement "$p" \
        --out "$OUT/bench.jsonl" --save-trace "$OUT/tr_$p" 2>&1 | tee -a "$OUT/steps.log" | grep -v "^  batch" | cut -c1-300
}
