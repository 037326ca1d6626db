"""The notebook training loops: `train(session, data, steps=...)` with a progress bar and a live dashboard,
and GRPO's (`train_grpo`) with the same dashboard.

Owns: pulling batches from an iterable, calling `Session.step` once per batch, the tqdm progress bar
(`progress_bar`: under the dashboard's header when there is one), dashboard refreshes inside Jupyter
(`open_dashboard` / `draw_dashboard`: the first step at once, then throttled, and at the end the static
figure that replaces the widget; for GRPO, from the `on_step` callback `post.rollout.train_grpo` calls after
each step), stopping cleanly on Jupyter's Stop (KeyboardInterrupt) or when the data runs out, and noting the
data position (`session.data_state`) for checkpoints. Does not own: what a step does (session / engine),
GRPO's steps (post/rollout.py), the figures (viz / dashboard) or checkpoint files (checkpoint). Bound as
`Session.train` and `Session.train_grpo`.
"""
from __future__ import annotations

import time
import warnings
from typing import Iterable

import pandas as pd


def train(session, data: Iterable[dict], *, steps: int, log_every: int = 1, dashboard: bool | None = None,
          refresh_s: float = 1.0, eval_data=None, eval_every: int | None = None, loss=None,
          group_size: int | None = None, temperature: float = 1.0) -> pd.DataFrame:
    """Train `steps` steps, one batch of `data` each, with a progress bar (and a dashboard in Jupyter).

    Jupyter's Stop (a KeyboardInterrupt) ends the loop after the step in flight: `Session.step`
    finishes it on every layer first (Note: [Interrupts] in session.py), so the session stays
    consistent and can keep training. The loop then closes the bar, prints one line and returns;
    it does not re-raise.

    Args:
        session: a `Session`.
        data: an iterable of batch dicts (`data.synthetic_batches`, `data.jsonl_batches`, a list...).
            When it has `state_dict()`, the position after each step is kept in
            `session.data_state`, which `save_checkpoint` stores.
        steps: how many steps to run (>= 1).
        log_every: refresh the bar's loss / tok/s / TFLOPS every this many steps.
        dashboard: None: show a `dashboard.Dashboard` when running in a Jupyter kernel; True: the
            same (with a warning outside Jupyter, where there is nothing to show it on); False: never.
        refresh_s: the dashboard redraws at most once per this many seconds (between steps, never
            inside one; the final state is always drawn).
        eval_data: held-out batches for `Session.evaluate` (`sft_batches(...)`: one pass each time,
            or a list of batches); its loss is drawn next to the training loss (`eval_loss`).
        eval_every: evaluate after every this many steps of this call, and after the last; None:
            after the last step only (when `eval_data` is given).
        loss: a loss hook for every step, `fn(logp, batch, ctx)` (`Session.step`'s `loss`); None:
            cross-entropy.
        group_size: rows of a pair or group that share a micro-batch (`Session.step`'s).
        temperature: the hook's logits are divided by it (`Session.step`'s).
    Returns:
        `session.history_dataframe()`: one row per step of the session (not only of this call).
    Raises:
        ValueError: `steps`, `log_every` or `refresh_s` out of range.
        Whatever `Session.step` raises for a bad batch (the steps before it are kept).
    Example:
        >>> from megatrain_nb.data import synthetic_batches                                   # doctest: +SKIP
        >>> df = train(s, synthetic_batches(cfg.vocab_size, batch=8, seq=128), steps=50)      # doctest: +SKIP
        >>> df.loss.iloc[-1] < df.loss.iloc[0]                                                # doctest: +SKIP
        True
    """
    for name, value, low in (("steps", steps, 1), ("log_every", log_every, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r}: must be an int >= {low}")
    if not refresh_s >= 0:
        raise ValueError(f"refresh_s={refresh_s!r}: must be >= 0 seconds")
    if eval_every is not None and (not isinstance(eval_every, int) or isinstance(eval_every, bool) or eval_every < 1):
        raise ValueError(f"eval_every={eval_every!r}: must be an int >= 1, or None (evaluate after the last step)")
    if eval_every is not None and eval_data is None:
        raise ValueError("eval_every is set but eval_data is None: pass eval_data=sft_batches(...) or a list of batches")
    if eval_data is not None and not hasattr(eval_data, "one_pass") and iter(eval_data) is eval_data:
        raise TypeError(f"eval_data is {type(eval_data).__name__}, an iterator that one evaluation would use up: "
                        "pass sft_batches(...) (one pass each time) or a list of batches")
    batches = iter(data)
    has_state = callable(getattr(data, "state_dict", None))
    dash = open_dashboard(session, dashboard)
    h0 = len(session.history)
    bar = progress_bar(dash, total=steps, desc="train")
    last_draw, interrupted, stepping, n = time.monotonic(), False, False, h0
    try:
        for k in range(steps):
            try:
                batch = next(batches)
            except StopIteration:
                warnings.warn(f"data ran out after {k} of {steps} steps; pass more data or fewer steps "
                              "(synthetic_batches and jsonl_batches never run out)", stacklevel=2)
                break
            n, stepping = len(session.history), True
            r = session.step(batch) if loss is None else session.step(batch, loss, group_size=group_size,
                                                                              temperature=temperature)
            stepping = False
            if has_state:
                session.data_state = data.state_dict()  # the position after this step's batch
            bar.update(1)
            if eval_data is not None and ((eval_every and (k + 1) % eval_every == 0) or k + 1 == steps):
                session.evaluate(eval_data)  # between steps: the next one runs as if it had not (inference.py)
            if (k + 1) % log_every == 0 or k + 1 == steps:
                post = {"loss": f"{r.loss:.4f}", "tok/s": f"{r.tokens / r.seconds:,.0f}", "TFLOPS": f"{r.tflops:.3g}"}
                if session.eval_history:
                    post["eval"] = f"{session.eval_history[-1]['eval_loss']:.4f}"
                bar.set_postfix(post, refresh=False)
            if dash is not None and (k == 0 or time.monotonic() - last_draw >= refresh_s):  # the first step at once
                dash = draw_dashboard(dash)
                last_draw = time.monotonic()
    except KeyboardInterrupt:  # Jupyter's Stop: Session.step already finished the step in flight
        interrupted = True
        bar.update(len(session.history) - h0 - bar.n)  # count a step that finished under the interrupt
        if has_state and stepping and len(session.history) > n:  # that step used its batch; else keep the last
            session.data_state = data.state_dict()
    finally:  # also when a step raised: the steps before it are kept, and so is their picture
        bar.close()
        if dash is not None:
            draw_dashboard(dash, final=True)  # the widget becomes a static figure that a saved notebook keeps
    if interrupted:
        done = len(session.history) - h0
        last = session.history[-1].step if session.history else 0
        print(f"interrupted: ran {done} of {steps} steps (the session is at step {last}, consistent; "
              "train again to continue)")
    return session.history_dataframe()


def train_grpo(session, prompts: list, reward_fn, *, dashboard: bool | None = None, refresh_s: float = 1.0,
               **kwargs) -> pd.DataFrame:
    """GRPO (``post.rollout.train_grpo``) with the dashboard drawn between its steps (see ``Session.train_grpo``).

    Args:
        session, prompts, reward_fn: ``post.rollout.train_grpo``'s.
        dashboard, refresh_s: as ``train``'s: the dashboard (None: in Jupyter only) redraws at most once per
            ``refresh_s`` seconds, between steps, and once at the end.
        **kwargs: the rest of ``post.rollout.train_grpo``'s keywords (steps, group_size, sampling, loss...).
    Returns:
        ``post.rollout.train_grpo``'s DataFrame: one row per step.
    Raises:
        ValueError: ``refresh_s`` < 0; whatever ``post.rollout.train_grpo`` raises.
    Example:
        >>> df = train_grpo(s, ["2+3="], lambda p, c: [float(x == "5") for x in c], steps=2)  # doctest: +SKIP
    """
    from .post import rollout

    if not refresh_s >= 0:
        raise ValueError(f"refresh_s={refresh_s!r}: must be >= 0 seconds")
    dash = open_dashboard(session, dashboard)
    steps = kwargs.get("steps")
    bar = progress_bar(dash, total=steps if isinstance(steps, int) else None, desc="grpo",
                       disable=not kwargs.pop("progress", True))
    last_draw, first = time.monotonic(), True

    def on_step(row: dict) -> None:
        nonlocal dash, last_draw, first
        if dash is not None and (first or time.monotonic() - last_draw >= refresh_s):  # the first step at once
            dash = draw_dashboard(dash)
            last_draw, first = time.monotonic(), False

    try:
        return rollout.train_grpo(session, prompts, reward_fn, on_step=on_step, progress=bar, **kwargs)
    finally:
        bar.close()
        if dash is not None:
            draw_dashboard(dash, final=True)  # the widget becomes a static figure that a saved notebook keeps


def in_jupyter() -> bool:
    """True inside a Jupyter (IPython) kernel, where widgets can be shown."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and hasattr(ip, "kernel")


def open_dashboard(session, want: bool | None):
    """Show a `dashboard.Dashboard` of `session` and return it, or return None (not wanted, not in
    Jupyter, or it failed to build). `want`: None: only in a Jupyter kernel; True: the same, with a
    warning outside one; False: never. Shared by `train` and `train_grpo`."""
    if want is False:
        return None
    if not in_jupyter():
        if want:
            warnings.warn("dashboard=True needs a Jupyter kernel to show it; training with the progress bar only",
                          stacklevel=3)
        return None
    try:
        from .view.dashboard import Dashboard

        dash = Dashboard(session)
        dash.display()
        return dash
    except Exception as e:  # a display problem must never stop training
        warnings.warn(f"dashboard disabled: {type(e).__name__}: {e}", stacklevel=3)
        return None


def progress_bar(dash, *, total: int, desc: str, disable: bool = False):
    """The run's tqdm bar: with a dashboard, a notebook bar placed under its header (and counted by it);
    else `tqdm.auto`'s. Shared by `train` and `post.rollout.train_grpo`.

    Args:
        dash: the `Dashboard` from `open_dashboard`, or None.
        total, desc, disable: tqdm's.
    Returns:
        A tqdm bar (close it when done).
    Example:
        >>> bar = progress_bar(None, total=3, desc="train", disable=True); bar.update(1); bar.close()
    """
    if dash is not None and not disable and callable(getattr(dash, "attach_bar", None)):
        try:
            from tqdm.notebook import tqdm as notebook_tqdm

            bar = notebook_tqdm(total=total, desc=desc, unit="step", display=False)
            dash.attach_bar(bar)
            return bar
        except Exception as e:  # no ipywidgets frontend: the plain bar
            warnings.warn(f"progress bar outside the dashboard: {type(e).__name__}: {e}", stacklevel=2)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, disable=disable)


def draw_dashboard(dash, *, final: bool = False):
    """Refresh the dashboard; `final`: the last time, replacing the live widget by its static figure
    (`Dashboard.finish`), which a saved notebook shows after a reload. On failure warn once and return
    None so training goes on without it."""
    try:
        if final and callable(getattr(dash, "finish", None)):
            dash.finish()
        else:
            dash.update()
        return dash
    except Exception as e:
        warnings.warn(f"dashboard update failed, hiding it for the rest of this run: {type(e).__name__}: {e}",
                      stacklevel=3)
        return None
