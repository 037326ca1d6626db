"""Host AdamW throughput of one unit, as the engine's worker runs it (HostAdamW.update).

Run on the GPU machine's host (or anywhere):
    python bench/host_adam.py --numel 77070336 --reps 5 --out out/host_adam.jsonl
One JSON line per variant, G params/s (median of reps): fp32 grads (torch's fused AdamW as is: the
ceiling, but 2 more bytes/param of host RAM), and bf16 grads upcast in chunks of --chunks elements
(the largest chunk is a whole slab: the upcast goes through DRAM).
"""
from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from rows import emit  # bench/ is on sys.path when this runs as a script

from megatrain_nb.config import OptimConfig
from megatrain_nb.optim import HostAdamW


def stand_in_store(n: int, grad_dtype: torch.dtype):
    """A HostStore stand-in with one unit of ``n`` elements (random master, small gradients of ``grad_dtype``)."""
    unit = types.SimpleNamespace(master=torch.randn(n) * 0.02, grad=torch.randn(n).to(grad_dtype) * 1e-3,
                                 exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))
    return types.SimpleNamespace(units={0: unit}, step_count=lambda u: torch.zeros(()))


def measure(n: int, grad_dtype: torch.dtype, chunk: int, reps: int) -> dict:
    HostAdamW.chunk_numel = chunk
    opt = HostAdamW(stand_in_store(n, grad_dtype), OptimConfig(lr=1e-5))
    opt.update(0, 1e-5)  # warm-up: scratch, thread pool
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.update(0, 1e-5)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return dict(bench="host_adam", numel=n, grad_dtype=str(grad_dtype).removeprefix("torch."),
                chunk=chunk if chunk < n else "whole", ms=round(t * 1e3, 2), gparams_per_s=round(n / t / 1e9, 3),
                threads=torch.get_num_threads(), torch=torch.__version__)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=77_070_336, help="default: one Qwen2.5-3B layer")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1 << 20, 1 << 22, 1 << 24, 1 << 40])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = [measure(a.numel, torch.float32, 1 << 40, a.reps)]
    rows += [measure(a.numel, torch.bfloat16, c, a.reps) for c in a.chunks]
    for row in rows:
        emit(row, a.out)


if __name__ == "__main__":
    main()
