#!/usr/bin/env bash
# What was, and is still, to measure on the H200 (after 2026-12-02's twelfth session: nothing pending for issue 9).
# Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_pending.sh MODE   (each ~1-10 minutes; carry .whl for the peers)
# s12:       Note [Split master] (a "device" layer's master held as bf16 weights + 16 bits; 10 bytes in, not 12):
#            stream 3B x 1 / x 4 with it and without it in one session (--split-master on off), each with Note [Mapped
#            reads] (344d487) on and off (--mapped-reads on off: measured once, s11c6, with no A/B), then
#            tests/test_gpu.py (last whole at 6c77d27, s11c5). Split on/off ran as s11c2 / s11c3.
# s11b:      the host's AdamW beside the DMA with the upcast in smaller chunks (bench/host_contention.py --chunks:
#            less host memory traffic), then stream x 1 / x 4 at the default chunk and at 1M elements (~5 minutes).
# tests:     the GPU tests over every module the device imports (plotly-based ones fail to collect).
# Done: s12 (s11c2, s11c3, s12c1; mapped reads alone: s12c2), s11 (s11c1), s10b (s10c5: Note [Late write-backs] beside d19320a), s9c (s10c1), s9 (s9c5), s9b (s9c6), placement (s9c1),
# s8d, search (s8c1, s8c2), peers7b (s8c1), s8b (s8c2), host RSS (s8c3), core (s7c1), depth (s7c1), layers (s5c1,
# s5c2), long and 512k (s5c3), twinflow (s7c1), width (s6c1).
# The modes kept for re-runs: layers, long (the 32K cache compare and 256K), core, depth, search, peers7b, s8b, s9c, s10b.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
wheels() {  # DeepSpeed and its missing requirements travel as wheels: carry .whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
}
gpu_tests() {  # LIMIT: tests/test_gpu.py into $OUT/gpu_tests.log, its verdict printed
    timeout "$1" python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/test_gpu.py -rA > "$OUT/gpu_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
}
beside_old() {  # DIR CODE: the same stream rows ($STEPS) from an older tree, unpacked in DIR with
    # git archive CODE megatrain_nb bench and carried; its rows into bench_CODE.jsonl, its traces tr_stream_CODE
    [ -d "$1" ] || return 0
    (cd "$1" && PYTHONPATH=$PWD OUT=$OUT/old STEPS=$STEPS bash -c '. bench/h200_lib.sh; mkdir -p $OUT; bench 3b stream 1 4')
    mv "$OUT/old/tr_stream" "$OUT/tr_stream_$2" && cat "$OUT"/old/bench.jsonl >> "$OUT/bench_$2.jsonl"
    cat "$OUT"/old/steps.log >> "$OUT/steps.log"; rm -rf "$OUT/old"
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
s9)  # the head group streamed (4187ca1): stream x 1 / x 4 beside the code before it (868ef78, unpacked in .s9old
     # with git archive 868ef78 megatrain_nb bench and carried), then tests/test_gpu.py (~7 minutes)
    . bench/h200_lib.sh
    export STEPS=8; bench 3b stream 1 4
    beside_old .s9old 868ef78
    gpu_tests 200
    pack && rm -rf "$OUT"/tr_* ;;
s12)  # Note [Split master]: stream 3B x 1 / x 4 with the masters split (the default) and not, each with Note
      # [Mapped reads] on (the default) and off, one session; then tests/test_gpu.py (~6 minutes)
    . bench/h200_lib.sh
    timeout 300 python3 bench/throughput.py --shape 3b --batch 1 4 --seq 4096 --steps 6 --placement stream \
        --split-master on off --mapped-reads on off --out "$OUT/bench_split.jsonl" --save-trace "$OUT/tr_split" 2>&1 | tee -a "$OUT/steps.log" \
        | grep -v "^  batch" | cut -c1-300
    gpu_tests 240
    pack && rm -rf "$OUT"/tr_* ;;
s11)  # Note [Early state] beside 35f5042, then tests/test_gpu.py (~6 minutes)
    . bench/h200_lib.sh
    export STEPS=6; bench 3b stream 1 4
    beside_old .s11old 35f5042
    timeout 240 python3 bench/throughput.py --shape 3b --batch 1 4 --seq 4096 --steps 6 --placement stream \
        --host-window 0.75 0.8 --out "$OUT/bench_window.jsonl" --save-trace "$OUT/tr_window" 2>&1 | tee -a "$OUT/steps.log" \
        | grep -v "^  batch" | cut -c1-300
    gpu_tests 200
    pack && rm -rf "$OUT"/tr_* ;;
s11b)  # the upcast's chunk beside the DMA, then stream x 1 / x 4 at the default chunk and at 1M elements (~5 minutes)
    (cd bench && timeout 120 python3 host_contention.py --beside alone dma --no-cast --threads 16 \
        --chunks 262144 1048576 4194304 16777216 --out "$OUT/host_contention.jsonl" | cut -c1-200)
    . bench/h200_lib.sh
    STEPS=6 bench 3b stream 1 4
    mv "$OUT/tr_stream" "$OUT/tr_stream_default"
    timeout 200 python3 bench/throughput.py --shape 3b --batch 1 4 --seq 4096 --steps 6 --placement stream --adam-chunk 1048576 \
        --out "$OUT/bench.jsonl" --save-trace "$OUT/tr_stream_1m" 2>&1 | tee -a "$OUT/steps.log" | grep -v "^  batch" | cut -c1-300
    pack && rm -rf "$OUT"/tr_* ;;
s10b)  # Note [Late write-backs] (no step waits for a state write-back): stream x 1 / x 4, then the same at d19320a
       # (.s10old: git archive d19320a megatrain_nb bench, carried), then tests/test_gpu.py (~6 minutes)
    . bench/h200_lib.sh
    export STEPS=6; bench 3b stream 1 4
    beside_old .s10old d19320a
    gpu_tests 200
    pack && rm -rf "$OUT"/tr_* ;;
s9c|s9b)  # stream x 1 / x 4, then tests/test_gpu.py (~5 minutes); s9b ran it at 586722b (pinned small inputs)
    . bench/h200_lib.sh
    STEPS=8 bench 3b stream 1 4
    gpu_tests 240
    pack && rm -rf "$OUT"/tr_* ;;
s8d)  # a109a71 (state write-backs on their own stream and thread): tests/test_gpu.py, then stream x 1 / x 4 (~3 minutes)
    gpu_tests 80
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
