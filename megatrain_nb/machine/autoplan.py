"""The planner's half of placement "auto": the predictions its choices are made from.

Owns: a ``planner.Hardware`` profile calibrated with what this machine measured (its device memory, the
host's AdamW rate inside the first step), the planner's steady step for an "auto" candidate's budget
(``candidate_step``, ``predictor``: what ``placement.Search.planned`` decides from), and the micro-batch
choice (``choose_micro_batch``, pure, and ``micro_batch_step``, its prediction), and the rows per pass
(``choose_pass_rows``, pure, and ``pass_rows``, Note: [Pass choice]).
Does not own: the rules the choices follow (placement.py's ``Search`` and ``pick``), measuring
(device_updates.py calls in with the numbers, at ``after_step`` and ``micro_batch``), the model of a
step (planner.py). No torch.

Note: [Micro-batch choice] ``EngineConfig.micro_batch_size`` splits a batch inside each layer: one load
of its weights serves every micro-batch, which run one after another, and every micro-batch's
activations of a kept layer stay until the backward. The gradients are those of the whole batch, with
one update a step. So a smaller micro-batch keeps as many bytes of activations as the whole batch; it
shrinks only the loss's chunk of logits and one layer's backward working set, and each layer then
costs at least one launch per micro-batch (``Hardware.layer_launch_ms``). ``micro_batch_step`` predicts
the whole batch's step from the planner's plan of it plus those launches; under "auto" the
micro-batch with the most tokens a second wins, ties to the larger (``choose_micro_batch``). With the
H200 profile no smaller micro-batch is predicted faster at 3B, 7B or 14B x 8 or 16 (seq 4096): what
makes 3B x 16 slower than x 8 a token (recomputed layers, the activations of 16 rows) does not shrink
with the micro-batch. The choice is made once per batch shape, before its measuring step, and named in
``Session.placement``.
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings

from . import placement as placing
from . import planner


def plan_settings(ecfg, grad_clip) -> dict:
    """``planner.plan``'s keywords from an engine's (resolved) ``EngineConfig`` and ``OptimConfig.grad_clip``."""
    names = set(inspect.signature(planner.plan).parameters) - {"placement", "config", "batch", "seq", "hardware"}
    out = {f.name: getattr(ecfg, f.name) for f in dataclasses.fields(ecfg) if f.name in names}
    out["grad_clip"] = grad_clip is not None
    return out


def calibrated(base: planner.Hardware = planner.H200, *, device_bytes: int | None = None,
               adam_params_per_s: float | None = None) -> planner.Hardware:
    """``base`` with this machine's device memory and the host's AdamW rate as measured inside a step (both
    of its AdamW rates scaled by it); None keeps ``base``'s.

    Example:
        >>> hw = calibrated(device_bytes=80 << 30, adam_params_per_s=1.74e9)
        >>> hw.device_mem_bytes >> 30, hw.host_adam_params_per_s, round(hw.host_adam_fp32_params_per_s / 1e9, 2)
        (80, 1740000000.0, 1.95)
    """
    kw = {}
    if device_bytes:
        kw["device_mem_bytes"] = int(device_bytes)
    if adam_params_per_s:
        scale = adam_params_per_s / base.host_adam_params_per_s
        kw.update(host_adam_params_per_s=float(adam_params_per_s),
                  host_adam_fp32_params_per_s=(base.host_adam_fp32_params_per_s or base.host_adam_params_per_s) * scale)
    return dataclasses.replace(base, name=base.name + "; calibrated with this machine's measurements", **kw) if kw else base


def _plan(config, **kw) -> planner.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a plan that does not fit is still a prediction; the engine measures
        return planner.plan(config, _advise=False, **kw)


def candidate_step(config, *, batch: int, seq: int, hardware: planner.Hardware, numel: dict[int, int],
                   free_bytes: int, dtype_bytes: int, tied: bool, settings: dict) -> tuple[float, float]:
    """(steady step s, the forward's wait for host updates s) the planner predicts for an "auto" candidate
    with ``free_bytes`` for residents: the units ``placement.choose`` makes resident in them (from the
    engine's own ``numel``), resident, and the activation policy the planner keeps beside them."""
    choice = placing.choose(numel, mode="auto", free_bytes=int(free_bytes), dtype_bytes=dtype_bytes, tied=tied,
                            cuda=True)
    residents = {u: "resident" for u, c in choice.items() if c.placement == "resident"}
    p = _plan(config, batch=batch, seq=seq, hardware=hardware, dtype_bytes=dtype_bytes, placement=residents,
              **settings)
    df = p.simulate_steady()
    return p.steady_step_ms / 1e3, float(df.loc[df.op == "wait-update", "dur_ms"].sum()) / 1e3


def predictor(config, **kw):
    """``placement.Search.planned``'s ``predict``: free bytes -> ``candidate_step(config, free_bytes=..., **kw)``."""
    return lambda free: candidate_step(config, free_bytes=free, **kw)


def micro_batch_step(config, *, batch: int, seq: int, micro: int, hardware: planner.Hardware, dtype_bytes: int,
                     settings: dict) -> float:
    """Predicted seconds of one step of ``batch`` rows in micro-batches of ``micro`` rows (Note: [Micro-batch
    choice]): the planner's steady step of the whole batch under "auto", plus, for each layer's forward and
    backward (and each recompute), the launches its micro-batches need beyond its compute."""
    p = _plan(config, batch=batch, seq=seq, hardware=hardware, dtype_bytes=dtype_bytes, placement="auto", **settings)
    k = batch // micro
    f, b = p.layer_ms["fwd"], p.layer_ms["bwd"]  # the whole batch's, at least one launch each
    lf, lb = hardware.layer_launch_ms
    extra_f, extra_b = k * max(f / k, lf) - f, k * max(b / k, lb) - b
    extra = len(p.keep) * (extra_f + extra_b) + p.recomputed_layers * extra_f
    return (p.steady_step_ms + extra) / 1e3


def choose_micro_batch(batch: int, seq: int, predict) -> int:
    """The micro-batch (a divisor of ``batch``) with the most tokens a second, ties to the larger
    (Note: [Micro-batch choice]).

    Args:
        batch, seq: the batch's rows and tokens per row.
        predict: micro-batch rows -> predicted seconds of one step of the whole batch split so.
    Returns:
        rows per micro-batch.

    Example:
        >>> choose_micro_batch(16, 4096, {16: 3.6, 8: 3.1, 4: 3.1, 2: 3.3, 1: 4.0}.get)
        8
    """
    best, best_rate = batch, batch * seq / predict(batch)
    for m in range(batch - 1, 0, -1):  # larger first: a smaller one must be faster, not as fast
        if batch % m == 0:
            rate = batch * seq / predict(m)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = m, rate
    return best


PASS_MARGIN = 0.08  # what a split must be predicted to gain, and what a larger pass may give up (Note: [Pass choice])


def choose_pass_rows(batch: int, seq: int, predict, margin: float = PASS_MARGIN) -> int:
    """Rows per pass (a divisor of ``batch``): the largest predicted within ``margin`` of the most tokens a
    second, where that beats the whole batch in one pass by ``margin`` (Note: [Pass choice]).

    Args:
        predict: rows -> predicted seconds of one step of that many rows (one pass).

    Example:
        >>> choose_pass_rows(16, 4096, {16: 3.58, 8: 1.58, 4: 0.74, 2: 0.37, 1: 0.25}.get)
        8
        >>> choose_pass_rows(8, 4096, {8: 1.58, 4: 0.74, 2: 0.37, 1: 0.25}.get)
        8
    """
    rate = {r: r * seq / predict(r) for r in range(batch, 0, -1) if batch % r == 0}
    best = max(rate.values())
    near = [r for r in rate if r < batch and rate[r] * (1 + margin) >= best]
    rows = max(near, default=batch)
    return rows if rate[rows] > rate[batch] * (1 + margin) else batch


def pass_rows(config, *, batch: int, seq: int, hardware: planner.Hardware, dtype_bytes: int,
              settings: dict) -> tuple[int, str]:
    """Placement "auto"'s rows per pass for ``batch`` x ``seq`` and why (``choose_pass_rows`` on the planner's
    steady step under "auto"); the whole batch where the planner cannot read the model.

    Note: [Pass choice] a pass of ``r`` rows is a whole step's forward and backward (Note: [Passes] in
    step/passes.py), so a step of ``batch`` rows in passes of ``r`` is predicted as ``batch / r`` of the
    planner's steady steps of ``r`` rows. That counts the host's AdamW once a pass where it runs once a step,
    and the weights' loads once a pass as they are: it leans to fewer passes. Where a batch's activations
    do not fit, the planner recomputes layers and keeps fewer: 3B x 16 at seq 4096 is predicted 12%
    slower a token than x 8 (measured 20% on the H200), so it runs as two passes of 8. A split must be
    predicted ``PASS_MARGIN`` faster, and the largest pass within ``PASS_MARGIN`` of the fastest is taken:
    the planner predicted the step within 10% on 24 of 25 rows, each pass loads the streamed layers again,
    and 3B x 4, predicted 7% faster a token than x 8, measured as fast (375 and 370 TFLOPS, README). Made
    once per batch shape, before its measuring step, and named in ``Session.placement``; the user's
    ``pass_batch_size`` or ``micro_batch_size`` wins.
    """
    try:
        seconds = {}

        def predict(r):
            p = _plan(config, batch=r, seq=seq, hardware=hardware, dtype_bytes=dtype_bytes, placement="auto",
                      **settings)
            seconds[r] = p.steady_step_ms / 1e3
            return seconds[r]

        r = choose_pass_rows(batch, seq, predict)
    except (ValueError, KeyError, TypeError) as e:
        return batch, f"one pass of {batch} rows: the planner cannot predict this model ({e})"
    pred = ", ".join(f"{k}: {k * seq / s:,.0f}" for k, s in sorted(seconds.items(), reverse=True))
    what = f"{batch // r} passes of {r} rows" if r < batch else f"one pass of {batch} rows"
    return r, f"{what}, the planner's most tokens a second (rows a pass: tokens/s {pred})"


def micro_batch(config, *, batch: int, seq: int, hardware: planner.Hardware, dtype_bytes: int,
                settings: dict) -> tuple[int, str]:
    """Placement "auto"'s micro-batch for ``batch`` x ``seq`` and why (``choose_micro_batch`` on
    ``micro_batch_step``); the whole batch where the planner cannot read the model."""
    try:
        seconds = {}

        def predict(m):
            seconds[m] = micro_batch_step(config, batch=batch, seq=seq, micro=m, hardware=hardware,
                                          dtype_bytes=dtype_bytes, settings=settings)
            return seconds[m]

        m = choose_micro_batch(batch, seq, predict)
    except (ValueError, KeyError, TypeError) as e:
        return batch, f"micro-batch {batch} (the whole batch): the planner cannot predict this model ({e})"
    pred = ", ".join(f"{k}: {batch * seq / s:,.0f}" for k, s in sorted(seconds.items(), reverse=True))
    return m, f"micro-batch {m} of {batch} rows, the planner's most tokens a second (rows: tokens/s {pred})"
