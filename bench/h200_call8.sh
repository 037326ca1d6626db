#!/usr/bin/env bash
# 2026-12-01 (third session), first device call (~8 minutes). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_call8.sh
# 1. the GPU tests (the allocator default, lean auto's long-context rule, the interrupt fix and stream's
#    weight slot per layer came after the last GPU run; modules that need plotly are skipped there);
# 2. issue 9's rows at today's defaults, the Session's own allocator setting (nothing set by hand):
#    7B x 8 auto, 3B stream 1/4 (a weight slot per layer), 3B auto 1/4/8.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu --continue-on-collection-errors tests/ -rA \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^(FAILED|ERROR) tests/test_(gpu|lean|checkpoint|soak|packing|shared|preflight|trace|placement|device)|passed|failed"
. bench/h200_lib.sh
bench 7b auto 8; pack
bench 3b stream 1 4; pack
bench 3b auto 1 4 8; pack
rm -rf "$OUT"/tr_*
