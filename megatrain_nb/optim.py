"""Host AdamW over the store's slabs, one unit at a time, as its gradients land.

Owns: one ``torch.optim.AdamW`` (fused CPU kernel) per unit whose single parameter is the unit's
flat fp32 master slab and whose state *is* the store's moment slabs; the LR schedule; the global
gradient-norm clip factor. The arithmetic is torch's own, so the semantics are exactly
``torch.optim.AdamW``'s (decoupled weight decay, bias correction).
Does not own: when an update runs (the engine's worker decides), devices or streams.
"""
from __future__ import annotations

import math

import torch

from .config import OptimConfig
from .host_store import HostStore


class HostAdamW:
    """AdamW over every unit of a HostStore."""

    def __init__(self, store: HostStore, cfg: OptimConfig):
        self.store, self.cfg = store, cfg
        self.opts: dict[int, torch.optim.AdamW] = {}
        self._scratch: torch.Tensor | None = None  # (max numel,) fp32: low-precision grads upcast here
        for u, unit in store.units.items():
            p = unit.master
            opt = torch.optim.AdamW([p], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                    weight_decay=cfg.weight_decay, fused=True)
            opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": unit.exp_avg, "exp_avg_sq": unit.exp_avg_sq}
            self.opts[u] = opt

    def steps_done(self, u: int) -> int:
        return int(self.opts[u].state[self.store.units[u].master]["step"].item())  # host tensor: no sync

    def set_steps_done(self, u: int, n: int) -> None:
        self.opts[u].state[self.store.units[u].master]["step"].fill_(n)

    def update(self, u: int, lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step on unit ``u`` with its grad slab times ``grad_scale`` (the clip factor)."""
        unit = self.store.units[u]
        g = unit.grad
        if g.dtype != torch.float32 or grad_scale != 1.0:
            n = g.numel()
            if self._scratch is None or self._scratch.numel() < n:
                self._scratch = torch.empty(max(n, max(x.grad.numel() for x in self.store.units.values())))
            g = self._scratch[:n].copy_(g)
            if grad_scale != 1.0:
                g.mul_(grad_scale)
        opt = self.opts[u]
        opt.param_groups[0]["lr"] = lr
        unit.master.grad = g
        try:
            opt.step()
        finally:
            unit.master.grad = None

    def clip_factor(self, norms: dict[int, float]) -> tuple[float, float]:
        """(total norm, factor) from per-unit L2 norms, as ``torch.nn.utils.clip_grad_norm_`` computes them."""
        total = math.sqrt(sum(n * n for n in norms.values()))
        if self.cfg.grad_clip is None:
            return total, 1.0
        return total, min(1.0, self.cfg.grad_clip / (total + 1e-6))
