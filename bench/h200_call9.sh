#!/usr/bin/env bash
# 2026-12-01 (third session), second device call (~7 minutes). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_call9.sh
# Issue 11's rows with default settings (the Session's own allocator setting, nothing set by hand):
# 1. 32K tiled against untiled from the same weights and batch (bf16 noise);
# 2. one process: 32K (3 steps), 128K (2 steps), 256K (1 step: the search's measuring step, which at long
#    context is also its last), each row with the planner's prediction beside it.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 170 python3 bench/long_context.py --mode compare --seq 32k --out "$OUT/long_context.jsonl" \
    2>&1 | tee "$OUT/long_compare.log" | tail -3 | cut -c1-600
timeout 400 python3 bench/long_context.py --seq 32k 128k 256k --steps 3 2 1 --out "$OUT/long_context.jsonl" \
    2>&1 | tee "$OUT/long_rows.log" | grep -v "^{" | cut -c1-300
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
