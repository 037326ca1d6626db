#!/usr/bin/env bash
# What is still to measure on the H200 (pending after 2026-12-01's second session). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_pending.sh [tests|placement|long|peers]   (about 8-10 minutes each)
# tests:     the GPU tests first — the allocator default (expandable segments), lean auto's long-context
#            rule, lean.auto, the interrupt fix came after the last GPU run (modules needing plotly skip).
# placement: 7B x 8 at today's defaults (lean auto turns lean on there; its residency-first trial ran out of
#            memory before the allocator default), 3B x 8 through the Session's own allocator setting;
#            host rows beside them in the same run; stream 3B 1/4 with its weight slot per layer.
# long:      issue 11's rows: 32K tiled vs untiled (bf16 noise), 256K; 512K runs on its own, detached
#            (see bench/long_context.py's docstring for the 512K command and its settings).
# peers:     issue 12's core sweep (carry .whl, built by bench/peers_wheels.sh; see bench/peers.py).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
case "${1:-tests}" in
tests)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu --continue-on-collection-errors tests/ -rA 2>&1 | tee "$OUT/gpu_tests.log" \
        | grep -E "^(FAILED|ERROR)|passed|failed" ;;
placement)
    . bench/h200_lib.sh
    bench 7b auto 8
    bench 3b auto 8
    bench 3b host 8
    bench 7b host 8
    bench 3b stream 1 4 ;;
long)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 250 python3 bench/long_context.py --mode compare --seq 32k \
        --out "$OUT/long_context.jsonl" 2>&1 | tail -3 | cut -c1-400
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 330 python3 bench/long_context.py --seq 256k --steps 1 \
        --out "$OUT/long_context.jsonl" 2>&1 | tail -3 | cut -c1-400 ;;
peers)  # DeepSpeed and its missing requirements travel as wheels: carry .whl (bench/peers_wheels.sh builds it)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
    python3 bench/peers.py --sweep core --budget-s 550 --out "$OUT/peers.jsonl" --log "$OUT/peers.log" | cut -c1-400 ;;
esac
