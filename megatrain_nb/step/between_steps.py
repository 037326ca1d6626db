"""A forward-only pass between steps: evaluation, log-probs and generation run here, on the driver thread.

Owns: the weights such a pass reads, through a step's loads (``stream_layers``: layers through the weight
slots, as a step's forward; ``weights_copy``: one unit's weights in a buffer of its own), and running one
such pass (``run_pass``): on the session's driver thread, after every pending update,
with no grad, on the compute stream, the model in eval mode and no trace recorded, the engine's handoffs
reset when it fails. Does not own: what the pass computes (``inference.py``: losses and log-probs;
``decode.py``: generation), the step, the optimizer (never touched here).

Note: [Eval between steps] a pass first waits for every pending update (``Engine.settle``), so
that it reads the weights after the last step, and so that a failure inside it (which resets the
engine's handoffs) drops no update. It keeps no graph and touches neither gradients, optimizer
state, the step count nor the activation policy; its loads record no trace (the recorder is set
aside for the pass). The next step therefore runs exactly as it would have without it.
"""
from __future__ import annotations

import contextlib

import torch

from ..view.trace import Recorder
from .schedule import forward_ops
from .workers import Box, run_uninterrupted


def run_pass(engine, driver, fn):
    """Run ``fn()`` as a pass between steps (Note: [Eval between steps]) on the driver thread; return its result.

    Args:
        engine: the session's ``Engine``.
        driver: the session's driver thread (``workers.run_uninterrupted``'s), where steps run.
        fn: a callable of no arguments, the pass; it reads the weights through the engine.
    Returns:
        What ``fn`` returned.
    Raises:
        RuntimeError: the engine is closed.
        KeyboardInterrupt: Jupyter's Stop came during the pass (after it finished; training state unchanged).
    Example:
        >>> n = run_pass(s.engine, s._driver, lambda: s.engine.L)  # doctest: +SKIP
    """
    if engine.closed:
        raise RuntimeError("this Session is closed; make a new one, or Session.resume(path) a checkpoint")

    def job():
        if engine.dev.cuda:
            torch.cuda.set_device(engine.dev.device)
        engine.settle()  # resident units are read where they live: no write-back to the host
        with _pass(engine):
            return fn()

    out, interrupted = run_uninterrupted(job, driver)
    if interrupted:
        raise KeyboardInterrupt("interrupted after the pass in flight finished; training state is unchanged")
    return out


@contextlib.contextmanager
def _pass(engine):
    """No grad, the compute stream, eval mode and no trace for one pass; the engine's handoffs reset on failure."""
    saved = engine.rec, engine.io.rec
    training = engine.arch.model.training
    engine.rec = engine.io.rec = Recorder(enabled=False, device=engine.dev.device)
    engine.arch.model.train(False)
    try:
        with torch.no_grad(), engine.dev.on(engine.dev.compute):
            yield
    except BaseException:
        engine._recover()  # nothing was pending (drained): no update is dropped
        raise
    finally:
        engine.rec, engine.io.rec = saved
        engine.arch.model.train(training)


# ---- the weights a pass reads (Engine.stream_layers, Engine.weights_copy) ----------------------
def stream_layers(engine, *, head: bool):
    """Driver: yield (unit, its weights on the device) for layers 0..L-1, then the head (unit L) if ``head``.

    Loads go through the weight slots from ``_master``, ordered as a step's forward; a slot is
    released once the caller has enqueued its compute and resumes the generator. The caller
    runs on the compute stream, under no_grad.
    """
    ops = forward_ops(engine.L)[:-1]
    engine._occ = []  # this pass's slot uses: no step's trace holds them
    plan = engine._plan(ops, [None] * len(engine.slots))
    head_box = engine._load_head() if head else None
    for k, op in enumerate(ops):
        yield op.layer, engine.store.units[op.layer].layout.views(engine._use(plan, k, op))
        engine._done(plan, k)
    if head:
        engine._ready(head_box)
        res = engine.dev_opt.of.get(engine.L)
        yield engine.L, engine.head_layout.views(engine.head_slot if res is None else res.w)
        engine.head_box = Box(ready=True, value=engine.dev.record(engine.dev.compute))  # the next head load waits


def weights_copy(engine, unit: int) -> dict:
    """Driver: a device copy of unit ``unit``'s current weights (0..L-1, or L: the head) outside the
    slots, for a caller that keeps it (generation); the compute stream waits for its load."""
    lay = engine.head_layout if unit == engine.L else engine.store.units[unit].layout
    buf = torch.empty(lay.numel, dtype=engine.dtype, device=engine.dev.device)
    if unit in engine.dev_opt.of:
        return lay.views(buf.copy_(engine.dev_opt.of[unit].w))  # resident: its current weights are there
    box = (engine._load_head(buf, Box(ready=True)) if unit == engine.L else
           engine.io.load(unit, buf, [(unit, engine._master(unit), 0)], Box(ready=True), "fwd", engine.steps_done))
    engine._ready(box)
    return lay.views(buf)
