#!/usr/bin/env bash
# 2026-12-01 (second session), second device call (~8 minutes). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_call6.sh
# 1. the GPU tests (lean activations, the three-candidate search, device_updates.py, the pinned shadow of
#    streamed units, the shared store's pinning) — modules that need plotly are skipped there;
# 2. placement rows with lean activations (default): 3B 1/4/8 and 7B 2/8 under auto, 3B 8 under host and
#    3B 8 auto without lean (--no-lean) beside them.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 230 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu --continue-on-collection-errors tests/ -rA \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^(FAILED|ERROR) tests/test_(gpu|lean|checkpoint|soak|packing|shared|preflight|trace)|passed|failed"
. bench/h200_lib.sh
bench 3b auto 1 4 8
bench 7b auto 2 8
bench 3b host 8
timeout 120 python3 bench/throughput.py --shape 3b --batch 8 --seq 4096 --steps 3 --placement auto --no-lean \
    --out "$OUT/bench.jsonl" 2>&1 | tee -a "$OUT/steps.log" | grep -v "^  batch" | cut -c1-300
tar czf "$OUT/traces.tgz" -C "$OUT" tr_auto tr_host 2>/dev/null; rm -rf "$OUT"/tr_*
