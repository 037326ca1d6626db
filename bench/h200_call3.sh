#!/usr/bin/env bash
# 2026-12-01, third device call (~9 minutes). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_call3.sh
# 1. GPU tests: placements (host, auto, stream, resident, mixed, streamed) within bf16 noise of native,
#    deliberate delays with resident and streamed units, CUDA resume, soak; packing's varlen path.
# 2. placement throughput with the auto search: 3B 1/4/8, 7B 2/8; 3B with placement="stream" at 1/4.
# 3. fine-tuning speed: packing's cost against unpacked rows, evaluation's tokens/s (3B, batch 4).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_gpu.py tests/test_checkpoint.py \
    tests/test_soak.py tests/test_packing.py -rA 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed"
. bench/h200_lib.sh
bench 3b auto 1 4 8
bench 7b auto 2 8
bench 3b stream 1 4
timeout 120 python3 bench/sft_speed.py --shape 3b --batch 4 --seq 4096 --steps 2 --out "$OUT/sft.jsonl" 2>&1 | cut -c1-250
tar czf "$OUT/traces.tgz" -C "$OUT" tr_auto tr_stream && rm -rf "$OUT/tr_auto" "$OUT/tr_stream"
