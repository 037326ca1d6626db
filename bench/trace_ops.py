"""Where a recorded step's time went: per compute op, count, total and mean ms; the recompute of each
layer; the compute lane's busy time against the step; the longest stalls of the compute lane and what
it waited on (``trace.find_stalls``); host AdamW that began before the step's origin (carried over from
the step before: the next forward may wait for it).

    python bench/trace_ops.py bench/traces/long-context/h200-2026-12-01-7b-512k.json.gz [more traces ...]
    python bench/trace_ops.py --stalls 3 bench/traces/stream/h200-2026-12-02-3b-b1.json.gz
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatrain_nb.view.trace import Trace, find_stalls  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--stalls", type=int, default=0, help="print the N longest compute stalls and the carried-over AdamW")
    a = ap.parse_args(argv)
    for path in a.traces:
        df = Trace.load(path).to_dataframe()
        c = df[df.lane == "compute"]
        print(f"{path}: step {df.end_ms.max():.1f} ms, compute busy {c.dur_ms.sum():.1f} ms")
        print(c.groupby("op").dur_ms.agg(["count", "sum", "mean"]).round(2).to_string())
        rec = c[c.op == "recompute"].set_index("layer").dur_ms.round(1).sort_index()
        if len(rec):
            print("recompute per layer (ms):", rec.to_dict())
        if a.stalls:
            st = find_stalls(df).sort_values("dur_ms", ascending=False).head(a.stalls)
            for r in st.itertuples():
                print(f"  stall {r.dur_ms:.1f} ms at {r.start_ms:.1f} ms before {r.phase} of layer {r.layer}: {r.diagnosis}")
            h = df[df.lane == "host-adam"]
            first = h[h.start_ms <= h.start_ms.min() + 1e-6] if len(h) else h
            carried = h[h.start_ms < (c.start_ms.min() if len(c) else 0)]
            for r in (carried if len(carried) else first).itertuples():
                print(f"  host AdamW of unit {r.layer}: {r.start_ms:.1f}-{r.end_ms:.1f} ms (the step's first compute at "
                      f"{c.start_ms.min():.1f} ms)")


if __name__ == "__main__":
    main()
