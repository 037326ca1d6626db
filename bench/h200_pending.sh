#!/usr/bin/env bash
# What is still to measure on the H200 (pending after 2026-12-01's fourth session). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_pending.sh MODE   (each ~1-10 minutes)
# tests:     the GPU tests over every module the device imports (plotly-based ones skip).
# layers:    issue 11, first (~1 min): one 7B layer's act / backward working set / cached attention at 64K and
#            128K under cuDNN, flash and efficient, beside longcontext's estimates (bench/layer_memory.py).
#            The estimates put 512K's plan at 130.5 GiB where the step peaked at 119.6 (s4c3): if the cuDNN
#            backward's working set is below `transient`, count it as measured; then 512K caches more layers
#            (4.1 s saved each; 556.8 s -> <= 546 s needs three).
# long:      issue 11: the cache's compare at 32K (every layer recomputed and cached, against the recompute,
#            beside the noise floor), then 256K (the placement since 4f38fee parks 2, not 4), traced.
# 512k:      issue 11's 512K row again, detached, across two calls:
#              PYTHONPATH=$PWD bash bench/h200_s4.sh start 545   then, within 30 s of its return,
#              PYTHONPATH=$PWD bash bench/h200_s4.sh wait 560
# placement: issue 9: 3B x 1 with ten timed steps (its steps vary 0.245-0.324 s), stream 3B 1/4 beside auto
#            (stream now with a state slot per streamed layer, 78fd0e9: planner 0.867 / 1.049 -> 0.784 / 0.953 s).
# twinflow:  issue 12: DeepSpeed Twin-Flow's batches 4-16 with megatrain-auto beside it (its batch 4 was killed
#            at s4c1's budget; its batch-1 step is 9.6 s, 8.2 s of it optimizer). Carry .whl.
# peers7b:   issue 12: the 7B sweep, then depth (36/72/108 layers) and width as time allows. Carry .whl.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
wheels() {  # DeepSpeed and its missing requirements travel as wheels: carry .whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
}
case "${1:-tests}" in
tests)
    timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu --continue-on-collection-errors tests/ -rA 2>&1 | tee "$OUT/gpu_tests.log" \
        | grep -E "^(FAILED|ERROR)|passed|failed" ;;
layers)
    timeout 300 python3 bench/layer_memory.py --seq 64k 128k --out "$OUT/layer_memory.jsonl" 2>&1 | tail -8 | cut -c1-400 ;;
long)
    timeout 200 python3 bench/long_context.py --mode compare --compare cache --checkpoint-every 1 --seq 32k \
        --out "$OUT/long_context.jsonl" 2>&1 | tail -4 | cut -c1-600
    timeout 380 python3 bench/long_context.py --seq 256k --steps 1 --out "$OUT/long_context.jsonl" \
        --save-trace "$OUT/tr_long" 2>&1 | tail -3 | cut -c1-400
    tar czf "$OUT/traces.tgz" -C "$OUT" tr_long && rm -rf "$OUT/tr_long" ;;
placement)
    . bench/h200_lib.sh
    STEPS=10 bench 3b auto 1 4
    STEPS=10 bench 3b stream 1 4
    pack && rm -rf "$OUT"/tr_* ;;
twinflow)
    wheels; python3 bench/peers.py --sweep core --systems megatrain-auto zero3-twinflow --batch 4 8 16 --budget-s 540 \
        --out "$OUT/peers.jsonl" --log "$OUT/peers.log" | cut -c1-400 ;;
peers7b)
    wheels; python3 bench/peers.py --sweep 7b depth width --budget-s 540 --out "$OUT/peers.jsonl" --log "$OUT/peers.log" | cut -c1-400 ;;
esac
