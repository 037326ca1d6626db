#!/usr/bin/env bash
# Everything still to measure on the H200, in two device calls (the second one ~10 minutes; split it if a step runs long). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_pending.sh tests   (then)   ... bench/h200_pending.sh bench
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ "${1:-}" != "bench" ]; then
# 1. GPU tests not yet run there: resume bit-identity, CUDA soak, preflight vs allocation, recorder axis
timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_checkpoint.py tests/test_soak.py \
    tests/test_preflight.py tests/test_trace.py tests/test_gpu.py -s 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
[ "${1:-}" = "tests" ] && exit 0   # call 1: `bash bench/h200_pending.sh tests`; call 2: `... bench`
# 2. tracing overhead: the same 3B step with the recorder on and off
timeout 100 python3 bench/throughput.py --shape 3b --layers 12 --batch 4 --seq 4096 --steps 3 --out "$OUT/bench.jsonl"
timeout 100 python3 bench/throughput.py --shape 3b --layers 12 --batch 4 --seq 4096 --steps 3 --no-trace --out "$OUT/bench.jsonl"
# 3. the device casts the pinned fp32 master (no host cast) vs the pinned bf16 copy (already logged)
timeout 120 python3 bench/throughput.py --shape 3b --batch 1 4 8 --seq 4096 --steps 2 --cast-on-device \
    --out "$OUT/bench.jsonl" --save-trace "$OUT"
# 4. depth: same width, 2x layers, boundary checkpoints parked in host memory (target: same peak within 5%)
timeout 60 python3 bench/throughput.py --shape 1.5b --batch 2 --seq 4096 --steps 1 --checkpoint-every 1 --offload-checkpoints --no-trace --out "$OUT/bench.jsonl"
timeout 70 python3 bench/throughput.py --shape 1.5b --layers 56 --batch 2 --seq 4096 --steps 1 --checkpoint-every 1 --offload-checkpoints --no-trace --out "$OUT/bench.jsonl"
# 5. the 7B shape (host RAM: ~106 GiB store; pin_store auto-off there)
timeout 200 python3 bench/throughput.py --shape 7b --batch 2 8 --seq 4096 --steps 1 --out "$OUT/bench.jsonl"
