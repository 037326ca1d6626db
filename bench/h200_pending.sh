#!/usr/bin/env bash
# What is still to measure on the H200, in one device call (~8 minutes). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_pending.sh        ("tests" as the argument: only the GPU tests)
# Pending since 2026-11-29 (second session): the pinned arena (host RSS should fall by ~11 GB at 3B),
# the tied embedding's gradient norm in row blocks (3B tail ~200 ms before), h2d bytes as they cross
# PCIe (fp32 under the device cast), and the GPU tests on that code.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_checkpoint.py tests/test_soak.py \
    tests/test_preflight.py tests/test_trace.py tests/test_gpu.py -rA 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^FAILED|passed|failed"
[ "${1:-}" = "tests" ] && exit 0
timeout 150 python3 bench/throughput.py --shape 3b --batch 1 4 8 --seq 4096 --steps 3 --out "$OUT/bench.jsonl" \
    --save-trace "$OUT" 2>/dev/null | cut -c1-420
timeout 200 python3 bench/throughput.py --shape 7b --batch 2 8 --seq 4096 --steps 2 --out "$OUT/bench.jsonl" \
    --save-trace "$OUT" 2>/dev/null | cut -c1-420
