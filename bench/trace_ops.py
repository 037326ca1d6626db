"""Where a recorded step's compute time went: per compute op, count, total and mean seconds; the recompute
of each layer; the compute lane's busy time against the step.

    python bench/trace_ops.py bench/traces/s4c3/tr/trace_7b_512k.json.gz [more traces ...]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatrain_nb.trace import Trace  # noqa: E402


def main(argv=None) -> None:
    for path in argv if argv is not None else sys.argv[1:]:
        df = Trace.load(path).to_dataframe()
        c = df[df.lane == "compute"]
        print(f"{path}: step {df.end_ms.max() / 1e3:.1f} s, compute busy {c.dur_ms.sum() / 1e3:.1f} s")
        ops = c.groupby("op").dur_ms.agg(["count", "sum", "mean"]) / [1, 1e3, 1e3]
        print(ops.round(2).to_string())
        rec = (c[c.op == "recompute"].set_index("layer").dur_ms / 1e3).round(2).sort_index()
        print("recompute per layer (s):", rec.to_dict())


if __name__ == "__main__":
    main()
