"""First-call costs of the forward without autograd, paid in the measuring step instead of a later one.

Owns: whether this step warms the no-grad forward (``due``) and the warm-up itself (``recompute``): the
first layer's forward run once more without autograd, its output dropped, the random state kept, and
its seconds taken out of the measured step's time. Does not own: the forward (engine.py calls in at one
point, after the first kept layer of a step), the activation policy (memory.py), the search (placement.py).

Note: [Warm recompute] under "auto" the measuring step keeps every layer it can, so a layer's forward
without autograd (what a recomputed layer's forward runs) first runs in a later step. On the H200
(2026-12-03, 14B x 2, int4 moments) the residency-first trial step stopped the driver for 742 ms inside
the forward of layer 2, its first recomputed layer, where the steady steps take 9 ms; the measuring step
before it had recomputed nothing. A first call of a kernel path can cost that once (cuDNN's attention,
for one, builds a graph per shape and mode on its first call); the cause is not yet confirmed on the GPU.
The measuring step is the run's first and is not held to the settling bound, so the same layer runs there
once more without autograd. The random state is forked (a dropout would draw otherwise), and the seconds
leave the measured step's time (``DeviceUpdates.t_start``), which ``host_bound`` compares with the host's
AdamW. Measured on the H200 (2026-12-03, the same shape): the warm-up took 588 ms in a fresh process on a fresh
machine and 40 ms on a warm one, and the trial step's compute then waited 10 ms in all for the driver.
"""
from __future__ import annotations

import time

import torch

from ..model.binding import call


def due(eng, k: int, kept: bool) -> bool:
    """Whether the forward's ``k``-th layer op warms the no-grad path: the first layer of a measuring step
    (Note: [Placement] in device_updates.py), kept, so that the no-grad forward has not run yet; in its
    first pass only (Note: [Passes] in passes.py)."""
    return k == 0 and kept and eng.pass_.index == 0 and eng.device_updates.measuring


def recompute(eng, layer: int, params: list, x: torch.Tensor, args: tuple) -> float:
    """Layer ``layer``'s forward on ``x`` (its input, one micro-batch) with ``params`` (its weight views)
    and ``args`` ((positional, keyword) of its call), without autograd, output dropped; returns its
    seconds, which leave the measured step's time (Note: [Warm recompute])."""
    t0 = time.perf_counter()
    devices = [eng.dev.device] if eng.dev.cuda else []
    with eng.rec.span("driver", "warm-recompute", layer, "fwd"), torch.random.fork_rng(devices=devices), torch.no_grad():
        call(eng._template(layer), params, x, *args[0], **args[1])
    seconds = time.perf_counter() - t0
    eng.device_updates.t_start += seconds
    return seconds
