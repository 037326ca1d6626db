"""Where does host RSS grow over many steps? The tiny CUDA soak model under variants, with tracemalloc.

Run on the GPU machine:  python bench/soak_probe.py --steps 120 --out out/soak_probe.jsonl
One JSON line per variant: RSS growth per step after warm-up, and the top Python allocation sites
that grew (tracemalloc), so a leak in Python objects is told apart from one below Python.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tracemalloc

import psutil
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from conftest import make_batches, make_config  # noqa: E402
from rows import emit  # noqa: E402

from megatrain_nb import Session  # noqa: E402

VARIANTS = {
    "default": {},
    "no_trace": {"trace": False},
    "no_overlap": {"overlap_optimizer": False},
    "no_trace_no_overlap": {"trace": False, "overlap_optimizer": False},
}


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def probe(name: str, settings: dict, steps: int, device: str, warm: int = 30) -> dict:
    cfg = make_config("llama", vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4)
    batches = make_batches(cfg.vocab_size, 10, batch=4, seq=256)
    s = Session.from_config(cfg, seed=0, device=device, **settings)
    for k in range(warm):
        s.step(batches[k % len(batches)])
    s.engine.drain()
    r0 = rss()
    for k in range(steps):  # RSS phase, no tracemalloc (its own bookkeeping would count)
        s.step(batches[k % len(batches)])
    s.engine.drain()
    r1 = rss()
    tracemalloc.start(8)  # Python phase: both snapshots hold one step's worth of live state
    for k in range(10):
        s.step(batches[k % len(batches)])
    s.engine.drain()
    gc.collect()
    snap0 = tracemalloc.take_snapshot()
    for k in range(40):
        s.step(batches[k % len(batches)])
    s.engine.drain()
    gc.collect()
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    top = snap1.compare_to(snap0, "traceback")[:5]
    s.close()
    return dict(variant=name, steps=steps, rss_growth_mib=round((r1 - r0) / 2**20, 2),
                kib_per_step=round((r1 - r0) / 1024 / steps, 1),
                python_growth_kib_40_steps=round(sum(d.size_diff for d in snap1.compare_to(snap0, "filename")) / 1024, 1),
                top=[f"{d.size_diff / 1024:+.1f} KiB x{d.count_diff:+d}: " + " <- ".join(
                    f"{os.path.basename(f.filename)}:{f.lineno}" for f in d.traceback[:4]) for d in top],
                device=device, torch=torch.__version__)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for name in a.variants:
        emit(probe(name, VARIANTS[name], a.steps, a.device), a.out)


if __name__ == "__main__":
    main()
