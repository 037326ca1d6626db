"""Host RSS beyond the buffers the planner counts, from bench/long_context.py rows (planner.H200.host_runtime_bytes).

    python bench/host_runtime.py [--results bench/results/h200-2026-12-01-long-context.jsonl] [--run 15 16]

For each row: the process's resident set after the step less the host bytes `plan` counts (fp32 master,
moments, gradients, pinned staging, the embedding-row gradient buffer) and the inputs the engine really
parked (the row's `parked`, whole 64 MiB chunks each). What is left is the CUDA context, torch and its
libraries: what the H200 profile adds as `host_runtime_bytes`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from shapes import qwen_config  # noqa: E402

from megatrain_nb.machine.longcontext import parked_bytes  # noqa: E402
from megatrain_nb.machine.planner import plan  # noqa: E402

_GIB = 1 << 30


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--results", default=os.path.join(here, "results", "h200-2026-12-01-long-context.jsonl"))
    ap.add_argument("--run", type=int, nargs="+", default=[15, 16], help="the rows' run numbers (the attention cache's runs)")
    a = ap.parse_args(argv)
    rows = [json.loads(ln) for ln in open(a.results) if ln.strip()]
    print("| run | seq | host RSS GiB | counted buffers GiB | parked | beyond GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r.get("run") not in a.run or "host_rss_gib" not in r:
            continue
        cfg = qwen_config(r["shape"], seq=r["seq"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = plan(cfg, batch=1, seq=r["seq"], cast_on_device=True, placement="auto")
        counted = sum(v for k, v in p.host_bytes.items() if k not in ("parked_checkpoints", "runtime"))
        counted += r["parked"] * parked_bytes(r["seq"] * cfg.hidden_size * 2)
        print(f"| {r['run']} | {r['seq'] // 1024}K | {r['host_rss_gib']:.1f} | {counted / _GIB:.1f} | {r['parked']} "
              f"| {r['host_rss_gib'] - counted / _GIB:.1f} |")


if __name__ == "__main__":
    main()
