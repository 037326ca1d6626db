"""Cost of the recorder: one session, steps alternating tracing on and off (ABAB…), so drift cancels.

Run on the GPU machine, e.g.:
    python bench/trace_overhead.py --shape 3b --layers 12 --batch 4 --seq 4096 --pairs 5 --out out/trace.jsonl
Prints and appends one JSON line: median step time with and without tracing, and the overhead in %.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit  # noqa: E402
from shapes import qwen_config  # noqa: E402

from megatrain_nb import Session  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="3b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--pairs", type=int, default=5, help="timed (on, off) pairs after one warm-up pair")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="append the JSON line here")
    a = ap.parse_args(argv)

    cfg = qwen_config(a.shape, layers=a.layers, seq=a.seq)
    s = Session.from_config(cfg, seed=0, device=a.device, lr=1e-5)
    g = torch.Generator().manual_seed(0)
    times = {True: [], False: []}
    for k in range(2 * (a.pairs + 1)):
        on = k % 2 == 0
        s.tracing = on
        r = s.step({"input_ids": torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g)})
        print(f"  step {k} tracing={on}: {r.seconds:.4f}s", file=sys.stderr, flush=True)
        if k >= 2:
            times[on].append(r.seconds)
    s.close()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    row = dict(bench="trace_overhead", shape=a.shape, layers=cfg.num_hidden_layers, batch=a.batch, seq=a.seq,
               step_s_trace=round(on, 4), step_s_no_trace=round(off, 4),
               overhead_pct=round(100 * (on - off) / off, 2),
               on_all=[round(x, 4) for x in times[True]], off_all=[round(x, 4) for x in times[False]],
               gpu=torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu", torch=torch.__version__)
    emit(row, a.out)
    return row


if __name__ == "__main__":
    main()
