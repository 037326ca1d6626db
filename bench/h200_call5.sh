#!/usr/bin/env bash
# 2026-12-01 (second session), first device call (~7 minutes). Writes under $OUT.
#   run: PYTHONPATH=$PWD bash bench/h200_call5.sh
# 1. every GPU test (device_updates.py, the auto search's OOM fallback and its third candidate came after
#    the last GPU run);
# 2. placement throughput with the three-candidate auto search: 3B 1/4/8 and 7B 8, host 3B 8 beside them;
#    stream 3B 1/4 (rows of one call compare; see docs/benchmarks.md).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/ -rA 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "^(FAILED|ERROR)|passed|failed"
. bench/h200_lib.sh
bench 3b auto 1 4 8
bench 3b host 8
bench 7b auto 8
bench 3b stream 1 4
tar czf "$OUT/traces.tgz" -C "$OUT" tr_auto tr_host tr_stream 2>/dev/null; rm -rf "$OUT"/tr_*
