#!/usr/bin/env bash
# What is still to measure on the H200 (pending after 2026-12-02's sixth session). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_pending.sh MODE   (each ~1-10 minutes; carry .whl for the peers)
# tests:     the GPU tests over every module the device imports (plotly-based ones skip).
# core:      issue 12: the whole core sweep in one run after e80f89a (a search trial's OOM reruns its batch) and
#            590057f (a new batch size's keep cap leaves out the residents that go): s6c2's batch 16 failed in a
#            trial and ZeRO-3's batch-4 ratio was 3.44 (target 3.5). ~13-16 minutes: detached across two calls,
#            PYTHONPATH=$PWD bash bench/h200_s6.sh start allcore 560   then   bash bench/h200_s6.sh wait - 560
# peers7b:   issue 12 / 9: the 7B sweep again (s6c1's 7B x 8 followed x 2 and kept 6 layers: the keep-cap fault).
# depth:     issue 12: depth with every layer recomputed at 72 layers (s6c2 ran 36 and 96), and with every update on
#            the host as well (megatrain-host-recompute: device memory flat in depth), 36 / 72 / 96 (~10 minutes;
#            or detached: bench/h200_s6.sh start depthflat).
# placement: issue 9: 3B x 1 (ten timed steps) and stream 3B x 1 / x 4 after the sixth session's driver-overhead
#            cut (d7a2315) and early rows (3d53e4a): s5c4 273.1, 88.1, 253.3 model TFLOPS against targets of 280,
#            110, 330; each batch in a process of its own. Then the GPU tests (tests mode) for both changes.
# Done: layers (s5c1, s5c2), long and 512k (s5c3), twinflow (s6c2: 31.3 / 63.4 / OOM at 4 / 8 / 16), width (s6c1).
# The modes kept for re-runs: layers, long (the 32K cache compare and 256K).
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
placement)
    . bench/h200_lib.sh
    STEPS=10 bench 3b auto 1 4
    STEPS=10 bench 3b stream 1 4
    pack && rm -rf "$OUT"/tr_* ;;
core)
    echo "run it detached: PYTHONPATH=\$PWD bash bench/h200_s6.sh start allcore 560, then bash bench/h200_s6.sh wait - 560" ;;
peers7b)
    wheels; python3 bench/peers.py --sweep 7b --systems megatrain-auto native --budget-s 540 --out "$OUT/peers.jsonl" \
        --log "$OUT/peers.log" | cut -c1-400 ;;
depth)
    python3 bench/peers.py --sweep depth --sweep-systems megatrain-recompute megatrain-host-recompute --depths 36 72 96 \
        --host-reserve-gib 4 --budget-s 560 --out "$OUT/peers.jsonl" --log "$OUT/peers.log" | cut -c1-400 ;;
esac
