"""Tests for megatrain_nb.view.dashboard: builds and updates without a frontend; figures tested by structure."""
from __future__ import annotations

import base64
import importlib.util

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from conftest import make_config
from megatrain_nb import Session
from megatrain_nb.view import dashboard as dashboard_mod
from megatrain_nb.view.dashboard import FIGURES, Dashboard, headline, peak_memory
from megatrain_nb.data import synthetic_batches

HAS_ANYWIDGET = importlib.util.find_spec("anywidget") is not None


@pytest.fixture
def session():
    s = Session.from_config(make_config("llama"), device="cpu", lr=1e-2, seed=0)
    yield s
    s.close()


@pytest.fixture(params=["figurewidget", "output"])
def backend(request, monkeypatch):
    """Both backends: FigureWidget (needs anywidget) and the Output fallback (forced by making
    FigureWidget unavailable)."""
    if request.param == "figurewidget" and not HAS_ANYWIDGET:
        pytest.skip("go.FigureWidget needs the anywidget package, which is not installed")
    if request.param == "output":
        monkeypatch.setattr(dashboard_mod, "_figure_widget", lambda: None)
    return request.param


def run(s, n: int) -> None:
    it = synthetic_batches(96, batch=2, seq=16, kind="successor", alphabet=96)
    for _ in range(n):
        s.step(next(it))


def test_builds_before_any_step_with_placeholders(session, backend):
    d = Dashboard(session)
    assert d.backend == backend
    assert set(d.figures) == set(FIGURES)
    assert isinstance(d.widget, widgets.VBox) and d.widget.children[0] is d.header
    assert len(d.widget.children) == 1 + len(FIGURES)
    for fig in d.figures.values():
        assert len(fig.data) == 0 and fig.layout.annotations[0].text in ("no steps yet", "no step yet")
    assert "<b>step</b> –" in d.header.value


def test_update_puts_the_new_loss_into_the_history_figure(session, backend):
    d = Dashboard(session)
    run(session, 3)
    d.update()
    losses = [r.loss for r in session.history]
    loss = next(t for t in d.figures["history"].data if t.name == "training loss")
    assert list(loss.x) == [1, 2, 3] and list(loss.y) == pytest.approx(losses)
    run(session, 1)
    d.update()
    loss = next(t for t in d.figures["history"].data if t.name == "training loss")
    assert list(loss.y)[-1] == pytest.approx(session.history[-1].loss) and len(loss.y) == 4
    assert "<b>step</b> 4" in d.header.value and f"{session.history[-1].loss:.4f}" in d.header.value


def test_figures_have_the_structure_of_the_viz_functions(session, backend):
    d = Dashboard(session)
    run(session, 2)
    d.update()
    hist = d.figures["history"]
    assert [t.name for t in hist.data] == ["training loss", "tokens/s", "model TFLOP/s"]  # one subplot each
    tl = d.figures["timeline"]
    bars = [t for t in tl.data if t.type == "bar"]
    assert bars and {t.legendgroup for t in bars} <= {"fwd", "loss", "recompute", "bwd", "optim", "io"}
    assert "compute" in tl.layout.yaxis.categoryarray and tl.layout.xaxis.title.text.endswith("(ms)")
    assert sum(len(t.x) for t in bars) == len(session.trace.to_dataframe())  # one bar per span
    mem = d.figures["memory"]
    assert [t.name for t in mem.data] == ["host RSS (whole process)"]  # CPU: no device counters
    assert mem.data[0].yaxis == "y2"


def test_history_figure_draws_the_steps_metrics(session, backend):
    """Metrics in StepResult.metrics (a loss hook's, train_grpo's reward_mean) get panels in the history figure."""
    d = Dashboard(session)
    run(session, 2)
    for r, v in zip(session.history, (0.25, 0.5)):
        r.metrics = {"reward_mean": v, "clip_ratio/region_mean": v / 10}
    d.update()
    hist = d.figures["history"]
    assert [t.name for t in hist.data] == ["training loss", "tokens/s", "model TFLOP/s", "reward_mean",
                                           "clip_ratio/region_mean"]
    assert list(hist.data[3].x) == [1, 2] and list(hist.data[3].y) == [0.25, 0.5]
    assert [a.text for a in hist.layout.annotations][-2:] == ["reward_mean", "clip_ratio"]


def test_update_replaces_rather_than_appends(session, backend):
    d = Dashboard(session)
    run(session, 1)
    d.update()
    n = {k: len(f.data) for k, f in d.figures.items()}
    d.update()
    assert {k: len(f.data) for k, f in d.figures.items()} == n


def test_output_backend_holds_a_plotly_mimebundle(session, monkeypatch):
    monkeypatch.setattr(dashboard_mod, "_figure_widget", lambda: None)
    d = Dashboard(session)
    run(session, 2)
    d.update()
    assert all(isinstance(f, go.Figure) for f in d.figures.values())
    for name in FIGURES:
        (out,) = d._outputs[name].outputs
        fig = out["data"]["application/vnd.plotly.v1+json"]
        assert len(fig["data"]) == len(d.figures[name].data)
    y = d._outputs["history"].outputs[0]["data"]["application/vnd.plotly.v1+json"]["data"][0]["y"]
    if isinstance(y, dict):  # plotly >= 6 writes arrays as base64 typed arrays, which plotly.js reads
        y = np.frombuffer(base64.b64decode(y["bdata"]), dtype=y["dtype"]).tolist()
    assert y == pytest.approx([r.loss for r in session.history])


def test_tracing_off_says_so(monkeypatch):
    s = Session.from_config(make_config("llama"), device="cpu", lr=1e-2, trace=False)
    try:
        monkeypatch.setattr(dashboard_mod, "_figure_widget", lambda: None)
        d = Dashboard(s)
        run(s, 1)
        d.update()
        assert d.figures["timeline"].layout.annotations[0].text == "tracing is off (trace=False)"
        assert len(d.figures["history"].data) == 3
    finally:
        s.close()


def test_peak_memory_sums_device_categories_carried_forward():
    counters = pd.DataFrame({"name": ["device_mem.weights", "device_mem.activations", "device_mem.activations",
                                      "host_rss_bytes", "host_rss_bytes"],
                             "t_ms": [0.0, 1.0, 2.0, 0.5, 1.5], "value": [10.0, 5.0, 2.0, 100.0, 300.0]})
    assert peak_memory(counters) == {"peak_device_bytes": 15.0, "peak_host_rss_bytes": 300.0}
    assert peak_memory(counters.iloc[:0]) == {"peak_device_bytes": None, "peak_host_rss_bytes": None}


def test_headline_numbers(session):
    h = headline(session)
    assert h["step"] is None and h["bytes_per_param"] == pytest.approx(16.0, abs=0.5)
    run(session, 2)
    h = headline(session)
    r = session.history[-1]
    assert (h["step"], h["loss"], h["tflops"]) == (2, r.loss, r.tflops)
    assert h["tokens_per_s"] == pytest.approx(r.tokens / r.seconds)
    assert h["peak_device_bytes"] is None and h["peak_host_rss_bytes"] > 0
