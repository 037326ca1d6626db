#!/usr/bin/env bash
# What is still to measure on the H200 (pending after 2026-12-02's seventh session). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_pending.sh MODE   (each ~1-10 minutes; carry .whl for the peers)
# search:    issue 9: the auto search after 1c056e5 (a trial is timed on its third step: s7c4's 7B x 8 timed C in the
#            step after its gated one, 4.15 s, and ran A at 396.7 against a target of 420; s3c1's C: 463.8) and
#            d611724 (trials unless the step is 5x the host AdamW: s7c1's 3B x 16 skipped them, 304.2; s4c1 330.2).
#            7B x 8 and 3B x 16, each in a process of its own, with traces (~6 minutes). Both also after 08fef7e
#            (the loss's chunk holds 1024 tokens at any batch: ~10 GiB more device memory at batch 8, ~22 at 16);
#            then the core sweep's megatrain rows again (bench/h200_s6.sh start s7: it re-runs every system).
# placement: issue 9: 3B x 1 and stream 3B x 1 / x 4 with ten timed steps and traces: s7c1 294.4, 88.9, 266.0
#            against targets of 280, 110, 330 (the traces say whether early rows fired and where stream waits).
# tests:     the GPU tests over every module the device imports (plotly-based ones fail to collect).
# peers7b:   issue 12: the 7B sweep with Twin-Flow too (its host estimate, 14.8 B/param x 7.6B = 105 GiB, fits the
#            machine's 126; FSDP2 and ZeRO-3 offload do not: 155 and 182 GiB). s7c4 ran megatrain and native only.
# s8b:       (eighth session) placement "stream" after held weights (a "device" unit's update refills its weight
#            slot: the next forward loads none of it), 3B x 1 / x 4 traced; 3B x 16 auto (after d611724 and 08fef7e);
#            then the GPU tests (~7 minutes).
# Done: core (s7c1: every issue-12 target met), depth with flat memory (s7c1: megatrain-host-recompute 36 / 72 / 84),
# layers (s5c1, s5c2), long and 512k (s5c3), twinflow (s7c1), width (s6c1), tests (s7c1: 41 passed).
# The modes kept for re-runs: layers, long (the 32K cache compare and 256K), core, depth.
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
    timeout 300 python3 bench/layer_memory.py --seq 32k 64k 128k 256k 512k --backends cudnn --out "$OUT/layer_memory.jsonl" \
        2>&1 | tail -8 | cut -c1-400 ;;
long)
    timeout 200 python3 bench/long_context.py --mode compare --compare cache --checkpoint-every 1 --seq 32k \
        --out "$OUT/long_context.jsonl" 2>&1 | tail -4 | cut -c1-600
    timeout 380 python3 bench/long_context.py --seq 256k --steps 1 --out "$OUT/long_context.jsonl" \
        --save-trace "$OUT/tr_long" 2>&1 | tail -3 | cut -c1-400
    tar czf "$OUT/traces.tgz" -C "$OUT" tr_long && rm -rf "$OUT/tr_long" ;;
search)
    . bench/h200_lib.sh
    STEPS=5 bench 7b auto 8
    STEPS=5 bench 3b auto 16
    pack && rm -rf "$OUT"/tr_* ;;
placement)
    . bench/h200_lib.sh
    STEPS=10 bench 3b auto 1 4
    STEPS=10 bench 3b stream 1 4
    pack && rm -rf "$OUT"/tr_* ;;
s8b)
    . bench/h200_lib.sh
    STEPS=6 bench 3b stream 1 4
    STEPS=5 bench 3b auto 16
    timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu --continue-on-collection-errors tests/ -rA \
        > "$OUT/gpu_tests.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
    pack && rm -rf "$OUT"/tr_* ;;
s8d)  # a109a71 (state write-backs on their own stream and thread): tests/test_gpu.py, then stream x 1 / x 4 (~3 minutes)
    timeout 80 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_gpu.py -rA > "$OUT/gpu_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
    . bench/h200_lib.sh
    STEPS=3 bench 3b stream 1 4
    pack && rm -rf "$OUT"/tr_* ;;
core)
    echo "run it detached: PYTHONPATH=\$PWD bash bench/h200_s6.sh start s7 540 1000, then bash bench/h200_s6.sh wait - 585 (twice)" ;;
peers7b)
    wheels; python3 bench/peers.py --sweep 7b --systems megatrain-auto native zero3-twinflow --host-reserve-gib 4 --budget-s 540 --out "$OUT/peers.jsonl" \
        --log "$OUT/peers.log" | cut -c1-400 ;;
depth)
    python3 bench/peers.py --sweep depth --sweep-systems megatrain-recompute megatrain-host-recompute --depths 36 72 96 \
        --host-reserve-gib 4 --budget-s 560 --out "$OUT/peers.jsonl" --log "$OUT/peers.log" | cut -c1-400 ;;
esac
