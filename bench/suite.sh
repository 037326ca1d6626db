#!/usr/bin/env bash
# The GPU runs behind README.md's and docs/benchmarks.md's tables, one named suite per question.
#
#   PYTHONPATH=$PWD bash bench/suite.sh SUITE...        (from the repository root, on the GPU machine)
#
# Suites (minutes on one H200; each row is appended to bench/results/<machine>-<date>-<subject>.jsonl,
# logs, traces and memory samples go under $OUT, default out/suite/):
#   defaults   megatrain_nb's defaults beside native PyTorch, each batch in a process of its own: 3B x 1 / 4 / 8,
#              then 7B x 2 / 8 (~10)                                                  -> <tag>-peers.jsonl
#   placement  bench/throughput.py: `auto` 3B x 1 / 4 / 8 and 7B x 2 / 8, traced (~8)  -> <tag>-placement.jsonl
#   stream     `placement="stream"` 3B x 1 / 4, traced (~4)                            -> <tag>-placement.jsonl
#   long       long context, 7B shape, one sequence: 32K, 128K, 256K in one process, then 512K alone (~15)
#                                                                                      -> <tag>-long-context.jsonl
#   layers     one 7B layer's memory at 32K-512K beside longcontext's estimate (~5)    -> <tag>-layer-memory.jsonl
#   peers      every system at 3B x 1 / 4 / 8 / 16, then the 7B shape (needs .whl: `wheels`) (~25)
#                                                                                      -> <tag>-peers.jsonl
#   depth      depth (3B width, 36 / 72 / 84 layers) and width (18 layers, hidden x1 / 1.5 / 2) sweeps (~20)
#                                                                                      -> <tag>-peers.jsonl
#   sft        packing's cost and evaluation's speed, 3B x 4 x 4096 (~3)               -> <tag>-fine-tuning.jsonl
#   passes     `auto` choosing passes: 3B x 8 beside 3B x 16 (two passes of 8), default settings, traced (~4)
#                                                                                      -> <tag>-passes.jsonl
#   posttrain  post-training speed, 7B shape: hook step vs CE, logprobs, reference pass, generation vs HF generate
#              (~6)                                                                    -> <tag>-post-training.jsonl
#   dp         data parallel, 7B, batch 8 per GPU, 1..N GPUs (several GPUs; not yet run) -> <tag>-data-parallel.jsonl
#   host       the host's AdamW alone, beside DMA, and beside a busy thread (~3)      -> <tag>-host-contention.jsonl
#   compact14  the Qwen2.5-14B shape with optimizer_state="int4" (default settings otherwise), x 8 then x 2 (~7)
#                                                                                      -> <tag>-compact-state.jsonl
#   compact    optimizer_state int8 beside fp32, each its own process: 7B x 8 under auto, then compact-stream;
#              then the host's AdamW rates, fp32 against the compact kernels and the libraries (~10)
#                                                                                      -> <tag>-compact-state.jsonl
#   compact-stream  3B x 1 under "stream" with fp32, int8 and int4 moments, each its own process (~3)
#                                                                                      -> <tag>-compact-state.jsonl
#   budgets    the smaller-machine targets, each its own process, x 8, 2 timed steps after 3: 7B int8 under 24 GiB device
#              / 64 GiB host, 14B int8 under 48 GiB / 118 GiB, 14B int8 without budgets, 7B fp32 defaults (~16)
#                                                                                      -> <tag>-budgets.jsonl
#   moe        the gpt-oss-20b shape (MoE) with int4 moments, x 8 on the stdlib's text (`--data stdlib`: the row's
#              loss_steps), 3 timed steps after 3: 4 layers first (a quick check that it runs), then all 24 (~7 on an H100)
#                                                                                      -> <tag>-moe.jsonl
#   settle     `auto`'s first steps, every step traced with its placement moves: 3B x 8, 7B x 8, then 14B x 2 int4 (~7)
#                                                                                      -> <tag>-placement.jsonl
#   planner    the planner against this kind of machine's rows (the H200's on a CPU machine; CPU only, ~1)
#   tests      the GPU tests: python -m pytest -m gpu over tests/ (~5)
#   all        tests defaults placement stream long layers sft host planner (~55; not peers, depth, dp, budgets, moe)
#   wheels     run HERE, not on the GPU machine: DeepSpeed and its requirements as wheels into .whl/
#              (the GPU machine has no internet; carry .whl there for peers and depth)
#
# A device call shorter than a suite: run it detached and come back for its output, e.g.
#   setsid nohup bash bench/suite.sh long > out/suite-long.log 2>&1 < /dev/null &
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-out/suite}; mkdir -p "$OUT" bench/results
PY=${PY:-python3}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$gpu" in *H200*) m=h200 ;; *H100*) m=h100 ;; "") m=cpu ;; *) m=$(echo "$gpu" | tr 'A-Z ' 'a-z-') ;; esac
n=$(nvidia-smi -L 2>/dev/null | wc -l); [ "${n:-0}" -gt 1 ] && m="$m-x$n"
TAG=${TAG:-$m-$(date -u +%F)}
R=bench/results/$TAG

memlog() {  # sample device and host memory every 5 s into $OUT/mem-$1.log until the suite ends
    (while sleep 5; do echo "$(date +%s) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)" \
        "$(free -m | awk '/Mem:/{print $3, $7}')"; done) > "$OUT/mem-$1.log" 2>&1 &
    trap "kill $! 2>/dev/null" EXIT
}
site() {  # DeepSpeed from the carried wheels (bench/suite.sh wheels), for the peers
    [ -d .whl ] || { echo "no .whl/: run 'bash bench/suite.sh wheels' where there is internet, then carry .whl"; return 1; }
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PYTHONPATH
}
throughput() {  # NAME ARGS...: bench/throughput.py at seq 4096, traced into $OUT/traces/NAME
    local name=$1; shift
    $PY bench/throughput.py --seq 4096 "$@" --out "$R-${SUBJECT:-placement}.jsonl" --save-trace "$OUT/traces/$name" \
        2>&1 | tee -a "$OUT/steps-$name.log" | grep -v "^  batch" | cut -c1-300
}

suite() {
    case "$1" in
    defaults)
        local P="$PY bench/peers.py --host-reserve-gib 4 --out $R-peers.jsonl --log $OUT/peers-defaults.log"
        $P --sweep core --systems megatrain-auto native --batch 1 4 8
        $P --sweep 7b --systems megatrain-auto --batch-7b 2 8 ;;
    placement)
        throughput auto-3b --shape 3b --batch 1 4 8 --steps 3 --placement auto
        throughput auto-7b --shape 7b --batch 2 8 --steps 3 --placement auto ;;
    stream)
        throughput stream-3b --shape 3b --batch 1 4 --steps 6 --placement stream ;;
    passes)
        SUBJECT=passes throughput passes-3b --shape 3b --batch 8 16 --steps 3 --placement auto ;;
    compact14)
        memlog compact14
        SUBJECT=compact-state throughput compact-14b --shape 14b --batch 8 2 --steps 3 --warmup 3 --optimizer-state int4 ;;
    compact)
        for st in int8 fp32; do
            SUBJECT=compact-state throughput compact-7b-$st --shape 7b --batch 8 --steps 3 --warmup 3 --optimizer-state $st
        done
        suite compact-stream
        $PY bench/host_adam.py --out "$R-compact-state.jsonl" 2>&1 | tail -12 | cut -c1-300 ;;
    compact-stream)  # the share streamed is set three times from the host's rate (Note [Stream rate]): 6 warm-up steps
        for st in int8 fp32 int4; do
            SUBJECT=compact-state throughput compact-stream-$st --shape 3b --batch 1 --steps 4 --warmup 6 \
                --placement stream --optimizer-state $st
        done ;;
    budgets)  # each row a process of its own: one run's host memory and allocator state never meet the next's
        memlog budgets
        local B="--batch 8 --steps 2 --warmup 3"
        SUBJECT=budgets throughput budgets-7b-int8-24g-64g --shape 7b $B --optimizer-state int8 \
            --device-memory 24GiB --host-memory 64GiB
        SUBJECT=budgets throughput budgets-14b-int8-48g-118g --shape 14b $B --optimizer-state int8 \
            --device-memory 48GiB --host-memory 118GiB
        SUBJECT=budgets throughput budgets-14b-int8 --shape 14b $B --optimizer-state int8
        SUBJECT=budgets throughput budgets-7b-fp32 --shape 7b $B ;;
    moe)
        memlog moe
        local M="--shape gpt-oss-20b --optimizer-state int4 --batch 8 --data stdlib --steps 3 --warmup 3"
        SUBJECT=moe throughput moe-gpt-oss-20b-4l $M --layers 4 || return 1  # a quick check that it runs at all
        SUBJECT=moe throughput moe-gpt-oss-20b $M ;;
    settle)
        SUBJECT=placement throughput settle-3b --shape 3b --batch 8 --steps 3 --warmup 3 --placement auto --trace-steps
        SUBJECT=placement throughput settle-7b --shape 7b --batch 8 --steps 3 --warmup 3 --placement auto --trace-steps
        SUBJECT=placement throughput settle-14b --shape 14b --batch 2 --steps 3 --warmup 3 --placement auto \
            --optimizer-state int4 --trace-steps ;;
    long)
        memlog long
        $PY bench/long_context.py --seq 32k 128k 256k --steps 2 1 1 --out "$R-long-context.jsonl" \
            --save-trace "$OUT/traces/long" 2>&1 | tee "$OUT/long.log" | grep -v "^{" | tail -6 | cut -c1-300
        $PY bench/long_context.py --seq 512k --steps 1 --out "$R-long-context.jsonl" \
            --save-trace "$OUT/traces/long" 2>&1 | tee -a "$OUT/long.log" | grep -v "^{" | tail -3 | cut -c1-300 ;;
    layers)
        $PY bench/layer_memory.py --seq 32k 64k 128k 256k 512k --backends cudnn --out "$R-layer-memory.jsonl" \
            2>&1 | tail -8 | cut -c1-400 ;;
    peers)
        site || return 1; memlog peers
        local P="$PY bench/peers.py --host-reserve-gib 4 --out $R-peers.jsonl --log $OUT/peers.log"
        $P --sweep core --systems megatrain-auto native fsdp2-offload zero3-offload megatrain-stream megatrain-host \
            zero3-twinflow --job-timeout 300
        $P --sweep 7b --systems megatrain-auto native zero3-twinflow --job-timeout 480 ;;
    depth)
        memlog depth
        local P="$PY bench/peers.py --host-reserve-gib 4 --out $R-peers.jsonl --log $OUT/peers-depth.log"
        $P --sweep depth --sweep-systems megatrain-auto megatrain-host-recompute --depths 36 72 84
        $P --sweep width --sweep-systems megatrain-auto ;;
    sft)
        $PY bench/sft_speed.py --shape 3b --batch 4 --seq 4096 --steps 2 --out "$R-fine-tuning.jsonl" 2>&1 | cut -c1-250 ;;
    posttrain)
        memlog posttrain
        $PY bench/posttrain.py --shape 7b --out "$R-post-training.jsonl" 2>&1 | cut -c1-300 ;;
    dp)
        $PY bench/data_parallel.py --device cuda --worlds $(seq -s ' ' 1 "${n:-1}") --shape 7b --seq 4096 --batch 8 \
            --out "$R-data-parallel.jsonl" --trace-dir "$OUT/traces/dp" 2>&1 | cut -c1-300 ;;
    host)
                $PY bench/host_adam.py --out "$R-host-adam.jsonl" | cut -c1-200 ;;
    planner)
        local pm=${PLAN_FOR:-$m}; [ "$pm" = cpu ] && pm=h200  # on a CPU machine: the H200's rows
        for f in bench/results/"$pm"-*-placement.jsonl bench/results/"$pm"-*-peers.jsonl; do
            [ -f "$f" ] && { echo "== $f"; $PY bench/planner_placement.py --results "$f" | tail -3; }
                done ;;
    tests)
        $PY -m pytest -q -p no:cacheprovider -o addopts="" -m gpu --continue-on-collection-errors tests/ -rA \
            > "$OUT/gpu-tests.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | tail -12 ;;
    all)
        for s in tests defaults placement stream long layers sft host planner; do suite "$s"; done ;;
    wheels)  # DeepSpeed 0.18.9 from its sdist with no op prebuilt (its cpu_adam JIT-compiles there, ~50 s) and the
             # requirements the GPU image lacks (cp312, manylinux x86_64); ~4.3 MB into .whl/ (ignored by git)
        local tmp; tmp=$(mktemp -d); mkdir -p .whl
        $PY -m pip download -q --no-deps --no-binary :all: deepspeed==0.18.9 -d "$tmp" \
            && DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation "$tmp"/deepspeed-0.18.9.tar.gz -w .whl \
            && $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
                pydantic==2.11.10 pydantic-core==2.33.2 annotated-types==0.8.0 typing-inspection==0.4.5 \
                typing-extensions==4.15.0 hjson==3.1.0
        rm -rf "$tmp"; ls -l .whl ;;
    -h|--help|help|"")
        sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' ;;
    *)
        echo "unknown suite '$1'; bash bench/suite.sh --help lists them" >&2; return 2 ;;
    esac
}

[ $# -eq 0 ] && set -- --help
for s in "$@"; do
    case "$s" in -h|--help|help) ;; *) echo "=== suite $s ($TAG, $(date -u +%FT%TZ))" ;; esac
    suite "$s" || echo "suite $s failed: $?"
done
