"""Tests for megatrain_nb.training.train: steps, falling loss, data running out, Jupyter's Stop, data position."""
from __future__ import annotations

import signal
import threading
import time

import pandas as pd
import pytest
import torch

from conftest import make_config
from megatrain_nb import Session
from megatrain_nb.data import synthetic_batches
from megatrain_nb.training import train

VOCAB = 96


@pytest.fixture
def session():
    s = Session.from_config(make_config("llama"), device="cpu", lr=1e-2, seed=0)
    yield s
    s.close()


def batches(seed: int = 0):
    return synthetic_batches(VOCAB, batch=4, seq=32, kind="successor", alphabet=VOCAB, seed=seed)


def test_train_returns_one_row_per_step_and_the_loss_falls(session):
    df = train(session, batches(), steps=12, log_every=5, dashboard=False)
    assert isinstance(df, pd.DataFrame)
    assert len(df) == 12 and df.step.tolist() == list(range(1, 13))
    assert {"loss", "tokens", "seconds", "tflops", "tokens_per_s"} <= set(df.columns)
    assert df.loss.iloc[-3:].mean() < df.loss.iloc[0] - 0.5  # 4.6 -> ~1.5 at lr 1e-2
    assert df.tokens.eq(4 * 32).all()


def test_train_continues_the_session_history(session):
    train(session, batches(), steps=3, dashboard=False)
    df = train(session, batches(seed=1), steps=2, dashboard=False)
    assert df.step.tolist() == [1, 2, 3, 4, 5]


def test_data_running_out_warns_and_keeps_the_steps_done(session):
    data = [next(batches()) for _ in range(3)]
    with pytest.warns(UserWarning, match="data ran out after 3 of 5 steps"):
        df = train(session, data, steps=5, dashboard=False)
    assert len(df) == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_steps_is_a_value_error(session, bad):
    with pytest.raises(ValueError, match="steps="):
        train(session, batches(), steps=bad, dashboard=False)


def test_interrupt_from_the_data_stops_cleanly_and_training_continues(session, capsys):
    def data():
        it = batches()
        for _ in range(3):
            yield next(it)
        raise KeyboardInterrupt  # as Jupyter's Stop would, while the loop waits for a batch

    df = train(session, data(), steps=10, dashboard=False)
    assert len(df) == 3
    assert "interrupted: ran 3 of 10 steps" in capsys.readouterr().out
    r = session.step(next(batches(seed=2)))  # the session is consistent and trains on
    assert r.step == 4
    assert len(train(session, batches(seed=3), steps=2, dashboard=False)) == 6


def test_interrupt_during_a_step_finishes_that_step_first(session, capsys, sigint_raises):
    """SIGINT lands while the engine runs step 3 (in the driver thread): Session.step finishes the step,
    re-raises, and train returns with 3 steps done instead of propagating."""
    engine_step, calls = session.engine.step, []

    def step(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            assert threading.current_thread() is not threading.main_thread()
            time.sleep(0.05)  # let the main thread reach its wait for this step
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # wakes it: KeyboardInterrupt
            time.sleep(0.05)  # the main thread takes the interrupt while this step still runs
        return engine_step(*a, **kw)

    session.engine.step = step
    with pytest.warns(UserWarning, match="finishing the current step"):
        df = train(session, batches(), steps=8, dashboard=False)
    assert len(df) == 3 and len(calls) == 3
    assert "interrupted: ran 3 of 8 steps" in capsys.readouterr().out
    assert session.step(next(batches(seed=4))).step == 4


class CountingData:
    """An iterable with a resumable position, like JsonlBatches."""

    def __init__(self):
        self.it, self.taken = batches(), 0

    def __iter__(self):
        return self

    def __next__(self):
        self.taken += 1
        return next(self.it)

    def state_dict(self):
        return {"taken": self.taken}


def test_data_position_is_kept_after_every_step(session):
    data = CountingData()
    seen = []
    orig = session.step

    def step(batch):
        r = orig(batch)
        seen.append(getattr(session, "data_state", None))  # before train records this step's position
        return r

    session.step = step
    train(session, data, steps=4, dashboard=False)
    assert seen == [None, {"taken": 1}, {"taken": 2}, {"taken": 3}]
    assert session.data_state == {"taken": 4}


def test_dashboard_true_outside_jupyter_warns_and_trains(session):
    with pytest.warns(UserWarning, match="needs a Jupyter kernel"):
        df = train(session, batches(), steps=2, dashboard=True)
    assert len(df) == 2


def test_dashboard_is_refreshed_throttled_in_jupyter(session, monkeypatch):
    from megatrain_nb import training

    draws = []

    class FakeDashboard:
        def __init__(self, s):
            assert s is session

        def display(self):
            pass

        def update(self):
            draws.append(len(session.history))

    import megatrain_nb.view.dashboard as dashboard_mod

    monkeypatch.setattr(training, "in_jupyter", lambda: True)
    monkeypatch.setattr(dashboard_mod, "Dashboard", FakeDashboard)
    train(session, batches(), steps=4, dashboard=None, refresh_s=0.0)
    assert draws == [1, 2, 3, 4, 4]  # every step (refresh_s=0), then the final state
    draws.clear()
    train(session, batches(), steps=4, refresh_s=3600.0)
    assert draws == [5, 8]  # the first step at once, then only the final draw: refreshes are throttled


def test_a_failing_dashboard_never_stops_training(session, monkeypatch):
    from megatrain_nb import training
    import megatrain_nb.view.dashboard as dashboard_mod

    class Broken:
        def __init__(self, s):
            pass

        def display(self):
            pass

        def update(self):
            raise RuntimeError("no frontend")

    monkeypatch.setattr(training, "in_jupyter", lambda: True)
    monkeypatch.setattr(dashboard_mod, "Dashboard", Broken)
    with pytest.warns(UserWarning, match="dashboard update failed"):
        df = train(session, batches(), steps=3, refresh_s=0.0)
    assert len(df) == 3


def test_steps_run_on_one_driver_thread_that_close_ends(session):
    """Note [Driver thread]: a thread per step left per-thread torch state behind (host RSS grew by
    the step on the H200); every step runs on the session's one driver thread, and close() ends it."""
    engine_step, threads = session.engine.step, []

    def step(*a, **kw):
        threads.append(threading.current_thread())
        return engine_step(*a, **kw)

    session.engine.step = step
    train(session, batches(), steps=3, dashboard=False)
    assert len(threads) == 3 and len(set(threads)) == 1 and threads[0] is not threading.main_thread()
    assert threads[0].name.startswith("megatrain-driver")
    session.close()
    threads[0].join(timeout=5)
    assert not threads[0].is_alive()
    with pytest.raises(RuntimeError, match=r"Session is closed .*Session.resume"):
        session.step(next(batches()))


def test_in_jupyter_the_bar_sits_in_the_dashboard_and_a_static_figure_replaces_it_at_the_end(session, monkeypatch):
    """The real Dashboard: the run's bar under its header, drawn after the first step, and after the last (or
    after a step that raised) its display is updated to the static figure, which a saved notebook keeps."""
    from megatrain_nb import training
    import megatrain_nb.view.dashboard as dashboard_mod

    shown, dashes = [], []

    class Handle:
        def update(self, obj):
            shown.append(obj)

    def display(self):
        self._handle = Handle()
        dashes.append(self)

    monkeypatch.setattr(training, "in_jupyter", lambda: True)
    monkeypatch.setattr(dashboard_mod, "_figure_widget", lambda: None)
    monkeypatch.setattr(dashboard_mod.Dashboard, "display", display)
    train(session, batches(), steps=3, refresh_s=3600.0)
    (d,) = dashes
    assert d.bar is not None and d.bar.n == 3 and d._progress.children == (d.bar.container,)
    (final,) = shown
    assert isinstance(final, dashboard_mod.StaticDashboard) and "3 of 3 this run" in final.figure.layout.title.text
    bad = [{"input_ids": torch.zeros(2, 8, dtype=torch.long)}] * 2 + [{"input_ids": "not a tensor"}]
    with pytest.raises((TypeError, ValueError)):
        train(session, bad, steps=3, refresh_s=0.0)
    assert len(shown) == 2 and "2 of 3 this run" in shown[-1].figure.layout.title.text  # the steps that ran
