#!/usr/bin/env bash
# 2026-12-01, fourth device call (~5 minutes). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_call4.sh
# 7B at 8 x 4096 with the auto search (its residency-first trial ran out of memory in call 3), then the
# long-context rows at 32K and 128K (7B, batch 1) with sequence tiling and checkpoint placement.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 150 python3 bench/throughput.py --shape 7b --batch 8 --seq 4096 --steps 2 --placement auto \
    --out "$OUT/bench.jsonl" --save-trace "$OUT" 2>&1 | grep -v "^  batch" | cut -c1-400
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 200 python3 bench/long_context.py --seq 32k 128k --steps 1 \
    --out "$OUT/long_context.jsonl" 2>&1 | tail -5 | cut -c1-600
