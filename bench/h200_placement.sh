#!/usr/bin/env bash
# Placement on the H200, one device call (~9 minutes). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_placement.sh [tests|bench]
# 1. the GPU tests (placements within bf16 noise of native; deliberate delays with resident units mixed in)
# 2. 3B shape at batch 1/4/8 with placement auto, host side by side; 7B at batch 2/8 with auto.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ "${1:-}" != "bench" ]; then
timeout 170 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_gpu.py tests/test_checkpoint.py \
    tests/test_soak.py tests/test_trace.py -rA 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed"
fi
[ "${1:-}" = "tests" ] && exit 0
for p in auto host; do
timeout 180 python3 bench/throughput.py --shape 3b --batch 1 4 8 --seq 4096 --steps 3 --placement $p \
    --out "$OUT/bench.jsonl" --save-trace "$OUT/tr_$p" 2>&1 | grep -v "^  batch" | cut -c1-600
done
[ "${1:-}" = "all" ] && timeout 200 python3 bench/throughput.py --shape 7b --batch 2 8 --seq 4096 --steps 2 --placement auto \
    --out "$OUT/bench.jsonl" --save-trace "$OUT/tr_auto" 2>&1 | grep -v "^  batch" | cut -c1-600
