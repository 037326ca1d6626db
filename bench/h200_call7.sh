#!/usr/bin/env bash
# 2026-12-01 (second session), third device call (~8 minutes). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_call7.sh
# 1. the GPU tests (modules that need plotly are skipped there);
# 2. placement rows at the default settings (lean_activations auto, the three-candidate search with its
#    out-of-memory retry): 3B 1/4/8, 7B 2/8 under auto; 3B 8 under host beside them.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu --continue-on-collection-errors tests/ -rA \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^(FAILED|ERROR) tests/test_(gpu|lean|checkpoint|soak|packing|shared|preflight|trace)|passed|failed"
. bench/h200_lib.sh
bench 3b auto 1 4 8; pack
bench 7b auto 2 8; pack
bench 3b host 8; pack
rm -rf "$OUT"/tr_*
