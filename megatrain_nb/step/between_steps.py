"""A forward-only pass between steps: evaluation, log-probs and generation run here, on the driver thread.

Owns: running one such pass (``run_pass``): on the session's driver thread, after every pending update,
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
from .workers import run_uninterrupted


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
