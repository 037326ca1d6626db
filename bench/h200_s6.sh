#!/usr/bin/env bash
# 2026-12-02 (sixth session): issue 12's remaining runs, and issue 9's rows beside the peers.
#   sweeps: depth (3B width, 36 / 72 / 96 layers: 108 needs ~129 GiB of host RAM at 16 B/param), width
#           (18 layers, hidden x1 / x1.5 / x2), then the 7B sweep (megatrain auto, native), batch 8 / 2 and 8.
#   core:   megatrain auto and ZeRO-3 offload at batch 1-16, Twin-Flow at 4-16 (its batch 1 ran in s4c1), then the
#           depth sweep with every layer recomputed (megatrain-recompute: TFLOPS flat in depth).
#   allcore: the whole core sweep, every system at batch 1-16 (issue 12's one run; next session).
#   depthflat: depth 36 / 72 / 96 with every layer recomputed, with auto and with host placement (flat memory).
#   s7:     (seventh session) the whole core sweep, Twin-Flow last; then megatrain-host-recompute (host updates,
#           block inputs in host memory: device memory flat in depth) at 36 / 72 / 84 layers (96 would need
#           ~12 GiB of pinned inputs beside its 114 GiB of host RAM); then the GPU tests. ~26 minutes, three calls.
#   s8a:    (eighth session) the 7B sweep's Twin-Flow (issue 12's last peer: its host estimate, 105 GiB, fits), then
#           megatrain auto at 7B x 2 / x 8 in the same run (issue 9's 7B x 8 after 1c056e5). ~9 minutes, two calls.
#   s10:    (tenth session) issue 9's default targets at today's code in one run: megatrain auto and native at
#           3B x 1 / 4 / 8, then megatrain auto at 7B x 2 / 8. No DeepSpeed (no .whl needed). ~10 minutes, two calls.
#   s8c:    (eighth session) the GPU tests; stream 3B x 1 / x 4 traced (held weights, the stream rate); megatrain auto
#           at 3B x 1-16 and 7B x 8 (host RSS with the 512 MiB staging pool). ~10 minutes, two calls.
# Each runs detached (setsid: it outlives the call) across device calls made within 30 s of each other:
#     PYTHONPATH=$PWD bash bench/h200_s6.sh start sweeps 560    then    bash bench/h200_s6.sh wait - 560
# Carry .whl (DeepSpeed and its requirements, bench/peers_wheels.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
D=/tmp/s6; mkdir -p "$D"
wheels() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
}
if [ "$1" = start ]; then
    [ "$2" = s10 ] || wheels  # s10 runs no DeepSpeed
    case "$2" in
    sweeps) CMD="python3 bench/peers.py --sweep depth width 7b --systems megatrain-auto native --depths 36 72 96 \
        --host-reserve-gib 4 --budget-s ${4:-1100} --out $D/peers.jsonl --log $D/peers.log" ;;
    core) P="python3 bench/peers.py --host-reserve-gib 4 --out $D/peers.jsonl --log $D/peers.log"
        CMD="$P --sweep core --systems megatrain-auto zero3-offload --budget-s 320; \
        $P --sweep core --systems zero3-twinflow --batch 4 8 16 --job-timeout 200 --budget-s 200; \
        $P --sweep depth --sweep-systems megatrain-recompute --depths 36 96 72 --budget-s 240" ;;
    allcore) CMD="python3 bench/peers.py --sweep core --host-reserve-gib 4 --job-timeout 300 --budget-s ${4:-1000} \
        --out $D/peers.jsonl --log $D/peers.log" ;;  # every system, batch 1-16: ~13-16 minutes
    depthflat) CMD="python3 bench/peers.py --sweep depth --sweep-systems megatrain-recompute megatrain-host-recompute \
        --depths 36 72 96 --host-reserve-gib 4 --budget-s ${4:-900} --out $D/peers.jsonl --log $D/peers.log" ;;
    s7) P="python3 bench/peers.py --host-reserve-gib 4 --out $D/peers.jsonl --log $D/peers.log"
        CMD="$P --sweep core --systems megatrain-auto native fsdp2-offload zero3-offload megatrain-stream megatrain-host \
        zero3-twinflow --job-timeout 300 --budget-s ${4:-1000}; \
        $P --sweep depth --sweep-systems megatrain-host-recompute --depths 36 72 84 --budget-s 330; \
        timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts='' -m gpu --continue-on-collection-errors tests/ -rA > $D/gpu_tests.log 2>&1" ;;
    s8a) rm -rf /tmp/s8code && mkdir -p /tmp/s8code && cp -r megatrain_nb bench /tmp/s8code/  # later calls' trees don't leak in
        P="cd /tmp/s8code && PYTHONPATH=/tmp/s8code:/tmp/site python3 bench/peers.py --host-reserve-gib 4 --out $D/peers.jsonl --log $D/peers.log --sweep 7b"
        CMD="$P --systems zero3-twinflow --steps 2 --job-timeout 480 --budget-s 480; $P --systems megatrain-auto --budget-s 330" ;;
    s8c) rm -rf /tmp/s8code && mkdir -p /tmp/s8code && cp -r megatrain_nb bench tests pyproject.toml /tmp/s8code/
        P="cd /tmp/s8code && PYTHONPATH=/tmp/s8code python3 bench/peers.py --host-reserve-gib 4 --out $D/peers.jsonl --log $D/peers.log"
        CMD="cd /tmp/s8code && timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts='' -m gpu --continue-on-collection-errors \
        tests/ -rA > $D/gpu_tests.log 2>&1; \
        cd /tmp/s8code && PYTHONPATH=/tmp/s8code OUT=$D timeout 200 python3 bench/throughput.py --shape 3b --batch 1 4 --seq 4096 --steps 6 \
        --placement stream --out $D/bench.jsonl --save-trace $D/tr_stream > $D/steps.log 2>&1; \
        $P --sweep core --systems megatrain-auto --budget-s 200; $P --sweep 7b --systems megatrain-auto --batch-7b 8 --budget-s 250" ;;
    s10) rm -rf /tmp/s10code && mkdir -p /tmp/s10code && cp -r megatrain_nb bench /tmp/s10code/
        P="cd /tmp/s10code && PYTHONPATH=/tmp/s10code python3 bench/peers.py --host-reserve-gib 4 --out $D/peers.jsonl --log $D/peers.log"
        CMD="$P --sweep core --systems megatrain-auto native --batch 1 4 8 --budget-s 330; \
        $P --sweep 7b --systems megatrain-auto --batch-7b 2 8 --budget-s 300" ;;
    *) echo "unknown mode $2: sweeps, core, allcore, depthflat, s7, s8a, s8c, s10"; exit 2 ;;
    esac
    setsid nohup bash -c "$CMD" > "$D/run.log" 2>&1 < /dev/null &
    echo $! > "$D/pid"
    setsid nohup bash -c "while sleep 5; do echo \$(date +%s) \$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits) \
        \$(free -m | awk '/Mem:/{print \$3, \$7}'); done" > "$D/mem.log" 2>&1 < /dev/null &
fi
t0=$(date +%s)
while kill -0 "$(cat "$D/pid")" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "${3:-560}" ]; do sleep 5; done
kill -0 "$(cat "$D/pid")" 2>/dev/null && echo "still running after $(( $(date +%s) - t0 )) s" || echo "process ended"
cp "$D"/peers.jsonl "$D"/peers.log "$D"/run.log "$D"/mem.log "$D"/gpu_tests.log "$D"/bench.jsonl "$D"/steps.log "$OUT"/ 2>/dev/null
[ -d "$D/tr_stream" ] && tar czf "$OUT/traces.tgz" -C "$D" tr_stream
tail -25 "$D/run.log" | cut -c1-300
grep -h "passed\|failed" "$D/gpu_tests.log" 2>/dev/null | tail -2
python3 -c "
import json
for l in open('$D/peers.jsonl'):
    r = json.loads(l); print(r['system'], r['sweep'], r['layers'], r['width'], r['batch'], r['status'], r['step_s'], r['model_tflops'], r['peak_gpu_gib'], r['host_rss_gib'], (r['error'] or '')[:150])
" 2>/dev/null
tail -1 "$D/mem.log"
