"""L2 norm of a long fp32 host tensor: torch.linalg.vector_norm vs optim.grad_norm, against fp64.

    python bench/host_norm.py --numel 311164928      (the 3B shape's embedding slab)
One JSON line per method: relative error and time (best of --reps).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit  # noqa: E402

from megatrain_nb.host.optim import grad_norm  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=311_164_928)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    x = torch.randn(a.numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = float(torch.dot(x.double(), x.double()).sqrt())
    for name, fn in (("torch.linalg.vector_norm", torch.linalg.vector_norm), ("optim.grad_norm", grad_norm)):
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            got = float(fn(x))
            times.append(time.perf_counter() - t0)
        emit(dict(bench="host_norm", method=name, numel=a.numel, rel_err=float(f"{abs(got - exact) / exact:.3g}"),
                  ms=round(min(times) * 1e3, 1), threads=torch.get_num_threads(), torch=torch.__version__), a.out)


if __name__ == "__main__":
    main()
