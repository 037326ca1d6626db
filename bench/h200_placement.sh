#!/usr/bin/env bash
# Placement on the H200, one device call (~7 minutes). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_placement.sh [tests]
# 1. the GPU tests (placements within bf16 noise of native; deliberate delays with resident units mixed
#    in; CUDA resume bit-exact under placement="auto"; soak)
# 2. throughput, side by side in one run: 3B at batch 1/4/8 and 7B at 2/8 with placement auto; host at
#    3B batch 1/4 and 7B batch 2 (today's path before placements).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 170 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_gpu.py tests/test_checkpoint.py \
    tests/test_soak.py tests/test_trace.py -rA 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed"
[ "${1:-}" = "tests" ] && exit 0
. bench/h200_lib.sh
bench 3b auto 1 4 8
bench 7b auto 2 8
bench 3b host 1 4
bench 7b host 2
