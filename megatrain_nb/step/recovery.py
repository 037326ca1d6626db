"""What a failed step leaves behind, put back: the recovery the engine runs when a step raised.

Owns: the order of the reset after a failure (the state write-backs first, then the abort of the step's jobs,
the GPU's queued work, the slots, the device updates, parked inputs, the attention cache, the passes, the
gradient ring, the Adam worker's error).
Does not own: what each piece resets (each module's own ``reset`` / ``recover``), nor when recovery runs
(``Engine.step``, and a pass between steps that failed: between_steps.py).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from . import passes, slot_plan

if TYPE_CHECKING:
    from .engine import Engine


def recover(eng: Engine) -> None:
    """After a failed step: stop its jobs, let the GPU finish what was queued, reset the handoffs.

    Updates that the Adam worker had already applied stay applied (see docs/engine.md, [Failed
    steps]); nothing is half-written: each unit's update is whole or absent: the state write-backs,
    which no step waits for (Note: [Late write-backs]), finish before anything is dropped.
    """
    with contextlib.suppress(Exception):  # a failed write-back: the failed step's own error stands
        eng.device_updates.wait_writes()
    eng.abort.set()
    eng.io.drain_quietly()
    with eng.adam.cond:
        while eng.adam.steps:  # the worker drops the abandoned step at its next wait
            eng.adam.cond.wait(0.05)
    if eng.dev.cuda:
        torch.cuda.synchronize(eng.dev.device)  # named sync, error path only: queued GPU work ends
    eng.abort.clear()
    slot_plan.reset(eng)  # every slot free, none holding current weights
    eng.device_updates.recover()
    eng.offload.reset()
    eng.attn_cache.clear()  # the failed step's backward will not come for them
    eng.pass_, eng.carry = passes.ONE, passes.Carry()  # the failed step's passes are dropped whole
    if eng.store.ring is not None:
        eng.store.ring.reset()  # no copy out is in flight now (the unpacker drained, the device synchronized)
    eng.adam.error = None
