#!/usr/bin/env bash
# 2026-12-01 (fifth session): issue 11 after counting the backward's working set as measured.
#   calib: one 7B layer's saved set, backward working set and cached attention at 64K and 128K per SDPA kernel
#          (bench/layer_memory.py), then the cache's compare at 32K (every layer recomputed and cached against
#          the recompute, beside the noise floor). ~3 minutes.
#   start / wait: 512K alone, then 32K (2 steps), 128K and 256K in a second process, then the GPU tests of the
#          cache, tiling and checkpoint placement, detached (setsid: they
#          outlive the call), across two device calls:
#     PYTHONPATH=$PWD bash bench/h200_s5.sh start 560   then, within 30 s of its return,
#     PYTHONPATH=$PWD bash bench/h200_s5.sh wait 560
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
D=/tmp/long; mkdir -p "$D"
case "${1:-calib}" in
calib)
    timeout 240 python3 bench/layer_memory.py --seq 64k 128k --out "$OUT/layer_memory.jsonl" 2>&1 | tee "$OUT/layer_memory.log" \
        | tail -8 | cut -c1-400
    timeout 240 python3 bench/long_context.py --mode compare --compare cache --checkpoint-every 1 --seq 32k \
        --out "$OUT/long_context.jsonl" 2>&1 | tee "$OUT/compare.log" | tail -5 | cut -c1-900 ;;
start|wait)
    . bench/h200_lib.sh
    [ "$1" = start ] && detached_start "$D" bash -c "python3 bench/long_context.py --seq 512k --steps 1 \
        --out $D/long_context.jsonl --save-trace $D/tr; python3 bench/long_context.py --seq 32k 128k 256k --steps 2 1 1 \
        --out $D/long_context.jsonl --save-trace $D/tr; timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts= -m gpu \
        tests/test_attncache.py tests/test_longcontext.py tests/test_tiling.py -rA > $D/gpu_tests.log 2>&1"
    detached_wait "$D" "${2:-540}" ;;
esac
