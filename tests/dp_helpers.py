"""Data-parallel helpers shared by tests/step/test_distributed.py and tests/host/test_shared_store.py: the
scenarios, the settings they share, joining a gloo group, a rank's rows, training on them and comparing.

The ranks that ``spawn_ranks`` (conftest.py) starts import this module as well: spawn hands them the parent's
sys.path, tests/ included (pyproject's pytest ``pythonpath``).
"""
from __future__ import annotations

import datetime
from pathlib import Path

import torch

from conftest import rel, rel_scalar

WORLD, ROWS, STEPS, SAVE_AT = 2, 2, 3, 2  # ranks, rows per rank, steps, checkpoint after this step
TOL = 1e-6
BASE = dict(device="cpu", dtype=torch.float32, lr=2e-3, betas=(0.9, 0.95), eps=1e-7)
SCENARIOS = {  # name -> (family, settings)
    "llama_host": ("llama", dict(placement="host")),
    "mixtral_auto_clip": ("mixtral", dict(placement="auto", grad_clip=0.05)),
    "llama_mixed": ("llama", dict(placement={0: "resident", 1: "device"})),
    "mixtral_stream": ("mixtral", dict(placement="stream")),
    "tied_resident": ("llama_tied", dict(placement={-1: "resident", 0: "resident", 2: "resident"})),
    "llama_private": ("llama", dict(placement="host", share_host_store=False)),  # a store per rank, as before
}


def shard(b: dict, rank: int, world: int) -> dict:
    """Rank ``rank``'s rows of batch ``b`` split over ``world`` ranks."""
    n = b["input_ids"].shape[0] // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in b.items()}


def join_group(rank: int, world: int, tmp: Path, timeout_s: float = 60) -> None:
    """Join the gloo process group of ``world`` ranks through a FileStore under ``tmp``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def masters(s) -> dict:
    """Every unit's fp32 master, cloned once the engine has drained."""
    s.engine.drain()
    return {u: s.store.units[u].master.clone() for u in s.store.order}


def train_shards(s, batches, rank=0, world=1, *, save: Path | None = None) -> dict:
    """Step ``s`` on this rank's rows of ``batches`` (a checkpoint to ``save`` after SAVE_AT steps):
    losses, grad norms and the final masters."""
    losses, norms = [], []
    for k, b in enumerate(batches):
        r = s.step(shard(b, rank, world))
        losses.append(r.loss), norms.append(r.grad_norm)
        if save is not None and k + 1 == SAVE_AT:
            from megatrain_nb.host.checkpoint import save_checkpoint

            save_checkpoint(s, save)
    return {"losses": losses, "norms": norms, "masters": masters(s)}


def assert_close(got: dict, want: dict, what: str, tol: float = TOL) -> None:
    """Losses and masters of ``got`` within relative ``tol`` of ``want``; ``what`` names the case."""
    for a, b in zip(got["losses"], want["losses"]):
        assert rel_scalar(a, b) <= tol, f"{what}: losses {got['losses']} vs {want['losses']}"
    for u in want["masters"]:
        d = rel(got["masters"][u], want["masters"][u])
        assert d <= tol, f"{what}: unit {u} weights differ by {d:.2e} (tolerance {tol})"


def train_single(d: Path, settings: dict, batches: list[dict]) -> dict:
    """``train_shards`` of a fresh one-process Session of ``d`` under BASE and ``settings``, closed after."""
    from megatrain_nb import Session

    s = Session.from_pretrained(d, **BASE, **settings)
    try:
        return train_shards(s, batches)
    finally:
        s.close()
