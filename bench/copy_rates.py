"""PCIe rates inside recorded steps: each copy lane's bytes over its spans' time, by kind of copy; and the
host's AdamW rate there.

The planner's `Hardware.h2d_beside_d2h_GBps` / `d2h_beside_h2d_GBps` come from here: in a
`placement="stream"` step the streamed layers' state goes in (h2d "state-in") while the previous one's
goes out (d2h "state-out") and the host's AdamW runs, so neither direction gets the isolated rate.
    python bench/copy_rates.py bench/traces/stream/h200-2026-12-02-3b-b1.json.gz bench/traces/stream/h200-2026-12-02-3b-b4.json.gz
One JSON row per trace and kind: GB/s, spans, GB. Then one row per trace for the host's AdamW (its "adam"
spans, 16 bytes per parameter as the engine records them): G params/s, spans. `Hardware.host_adam_beside_stream_params_per_s`
comes from this row on `stream` traces of 2026-12-02: the host's AdamW beside the state's copies, not alone.
"""
from __future__ import annotations

import argparse
import collections
import json

from megatrain_nb.view.trace import Trace


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    a = ap.parse_args(argv)
    for path in a.traces:
        tr = Trace.load(path)
        by = collections.defaultdict(lambda: [0, 0.0, 0])  # (lane, name) -> bytes, ms, spans
        for lane, name, unit, phase, t0, t1, nbytes in tr.spans:
            if lane in ("h2d", "d2h", "d2h-state") and nbytes and t1 > t0:
                b = by[(lane, name if name != lane else f"{lane} ({phase})")]
                b[0] += nbytes
                b[1] += t1 - t0
                b[2] += 1
        for (lane, kind), (nbytes, ms, n) in sorted(by.items()):
            print(json.dumps(dict(trace=path, lane=lane, kind=kind, GBps=round(nbytes / ms / 1e6, 1), spans=n,
                                  GB=round(nbytes / 1e9, 2))))
        adam = [(nbytes / 16, t1 - t0) for lane, name, _, _, t0, t1, nbytes in tr.spans
                if lane == "host-adam" and name == "adam" and nbytes and t1 > t0]
        if adam:
            params, ms = sum(p for p, _ in adam), sum(m for _, m in adam)
            print(json.dumps(dict(trace=path, lane="host-adam", kind="adam", G_params_per_s=round(params / ms / 1e6, 2),
                                  spans=len(adam), G_params=round(params / 1e9, 2))))


if __name__ == "__main__":
    main()
