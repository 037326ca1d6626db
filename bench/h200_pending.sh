#!/usr/bin/env bash
# What to measure on the H200 in one device call (~8 minutes). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_pending.sh            (or with "tests" to run only the GPU tests)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
# 1. GPU tests: equivalence, delays, resume bit-identity, CUDA soak, preflight vs allocation, recorder axis
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_checkpoint.py tests/test_soak.py \
    tests/test_preflight.py tests/test_trace.py tests/test_gpu.py -s 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
[ "${1:-}" = "tests" ] && exit 0
# 2. host AdamW of one 3B layer: fp32 grads vs bf16 grads upcast in chunks
timeout 60 python3 bench/host_adam.py --out "$OUT/bench.jsonl" | cut -c1-160
# 3. tracing overhead: one session, steps alternating trace on / off
timeout 90 python3 bench/trace_overhead.py --shape 3b --layers 12 --batch 4 --pairs 6 --out "$OUT/bench.jsonl" 2>/dev/null
# 4. host RSS per step after warm-up (the driver thread is now one per session)
timeout 60 python3 bench/soak_probe.py --steps 150 --variants default --out "$OUT/bench.jsonl" | cut -c1-200
# 5. 3B at transfer-bound and compute-bound batches, default settings (auto pinning = device cast)
timeout 150 python3 bench/throughput.py --shape 3b --batch 1 4 8 --seq 4096 --steps 3 --out "$OUT/bench.jsonl" \
    --save-trace "$OUT" 2>/dev/null | cut -c1-420
# 6. the 7B shape
timeout 170 python3 bench/throughput.py --shape 7b --batch 2 8 --seq 4096 --steps 1 --out "$OUT/bench.jsonl" 2>/dev/null | cut -c1-420
