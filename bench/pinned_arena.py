"""Host bytes the store's pinned slabs take: torch's power-of-two rounding slab by slab vs host_store.carve.

Pure arithmetic (no pinning, runs anywhere):
    python bench/pinned_arena.py --shape 3b 7b
One JSON line per shape: GiB of data, GiB pinned slab by slab (each request rounded up to a power of
two, as torch's pinned allocator does), GiB in carve's power-of-two blocks.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rows import emit  # noqa: E402
from shapes import qwen_config  # noqa: E402

from megatrain_nb.model.hf import load_architecture  # noqa: E402
from megatrain_nb.host.host_store import carve, unit_layouts  # noqa: E402


class _Block:
    """Stands in for a pinned uint8 block: carve only slices it and views the slice."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def __getitem__(self, sl):
        return self

    def view(self, dtype):
        return self


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["3b", "7b"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for shape in a.shape:
        arch = load_architecture(qwen_config(shape))
        want = {}  # what the default on CUDA pins (cast_on_device): fp32 masters, bf16 grads but the embedding's
        for u, (layout, _) in unit_layouts(arch).items():
            want[u, "master"] = (layout.numel, torch.float32)
            if u != -1:
                want[u, "grad"] = (layout.numel, torch.bfloat16)
        nbytes = {k: n * torch.tensor([], dtype=dt).element_size() for k, (n, dt) in want.items()}
        blocks = []
        carve(want, lambda n: blocks.append(_Block(n)) or blocks[-1])
        emit(dict(bench="pinned_arena", shape=shape, data_GiB=round(sum(nbytes.values()) / 2**30, 2),
                  slab_by_slab_GiB=round(sum(1 << (n - 1).bit_length() for n in nbytes.values()) / 2**30, 2),
                  carved_GiB=round(sum(b.nbytes for b in blocks) / 2**30, 2), blocks=len(blocks)), a.out)


if __name__ == "__main__":
    main()
