"""Tests for megatrain_nb.view.dashboard: builds and updates without a frontend; figures tested by structure."""
from __future__ import annotations

import base64
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

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
from megatrain_nb import training
from megatrain_nb.view import viz
from megatrain_nb.view.trace import Trace, find_stalls

ROOT = Path(__file__).resolve().parents[2]  # the repository
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
    assert len(d.widget.children) == 2 + len(FIGURES)  # header, the run's bar, the figures
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
    assert bars and {t.legendgroup for t in bars} <= {"fwd", "loss", "recompute", "bwd", "optim", "io", "wait"}  # wait: held, not working
    assert "compute" in tl.layout.yaxis.categoryarray and tl.layout.xaxis.title.text.endswith("(ms)")
    assert sum(len(t.x) for t in bars) == len(session.trace.to_dataframe())  # one bar per span
    mem = d.figures["memory"]  # CPU: no device counters, no device panel; the host store by category, in MiB
    assert [t.name for t in mem.data] == ["fp32 master weights", "AdamW 1st moment", "AdamW 2nd moment",
                                          "gradient ring (host buffers)", "embedding gradient, touched rows (fp32)"]
    # no gradient slab at all: the ring's buffers and the untied embedding's touched rows
    assert {t.yaxis for t in mem.data} == {"y"} and mem.layout.yaxis.title.text == "MiB"
    assert sum(t.y[0] for t in mem.data) == pytest.approx(session.memory_report()["total"] / 2**20)
    assert tl.layout.title.text == "step 2, lane by lane"  # short: not the Session's repr
    buf = d.figures["buffers"]  # which layer each weight / grad slot holds, from the trace's slot records
    assert {t.name for t in buf.data} <= {"loading", "ready", "computing"} and buf.data
    assert any(t.startswith("weight slot") for t in buf.layout.yaxis.ticktext)
    assert any(t.startswith("grad slot") for t in buf.layout.yaxis.ticktext)


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
    assert len({t.yaxis for t in hist.data}) == 5  # each metric on its own axis, not the loss's
    run(session, 1)
    for r in session.history:
        r.metrics = {"reward_mean": 0.5, "kl": 0.0}  # flat over 3 steps: no row
    d.update()
    assert [t.name for t in d.figures["history"].data] == ["training loss", "tokens/s", "model TFLOP/s"]


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
        assert "<b>stalls</b> –" in d.header.value
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
    assert h["step"] is None and h["bytes_per_param"] == session.memory_report()["bytes_per_param"]
    run(session, 2)
    h = headline(session)
    r = session.history[-1]
    assert (h["step"], h["loss"], h["tflops"]) == (2, r.loss, r.tflops)
    assert h["tokens_per_s"] == pytest.approx(r.tokens / r.seconds)
    assert h["peak_device_bytes"] is None and h["peak_host_rss_bytes"] > 0


def test_header_counts_the_run_and_the_session_and_names_the_stalls(session, monkeypatch):
    monkeypatch.setattr(dashboard_mod, "_figure_widget", lambda: None)
    run(session, 2)
    d = Dashboard(session)
    bar = training.progress_bar(d, total=5, desc="train")
    bar.update(1)
    d.update()
    assert d.bar is bar and d._progress.children == (bar.container,)  # the bar sits under the header
    assert "<b>step</b> 1 of 5 this run · session step 2" in d.header.value
    h = headline(session, bar)
    stalls = session.stalls()
    assert h["stall_ms"] == pytest.approx(stalls.dur_ms.sum())
    assert h["stall_cause"] == stalls.groupby("waited_on").dur_ms.sum().idxmax()
    assert f"{h['stall_ms']:.3g} ms (mostly {h['stall_cause']})" in d.header.value
    bar.close()


def _fake_handle():
    class Handle:
        shown = []

        def update(self, obj):
            self.shown.append(obj)

    return Handle()


def test_finish_replaces_the_widget_by_a_static_figure_a_saved_notebook_keeps(session, monkeypatch):
    """The live widget's display is updated in place to plain output (plotly JSON, HTML): what Jupyter saves."""
    monkeypatch.setattr(dashboard_mod, "_figure_widget", lambda: None)
    d = Dashboard(session)
    d._handle = handle = _fake_handle()
    run(session, 2)
    final = d.finish()
    assert handle.shown == [final] and isinstance(final, dashboard_mod.StaticDashboard)
    bundle = final._repr_mimebundle_()
    assert {"application/vnd.plotly.v1+json", "text/html", "text/plain"} <= set(bundle)
    assert "megatrain-header" in bundle["text/html"] and "plotly" in bundle["text/html"]
    assert ("image/png" in bundle) == (importlib.util.find_spec("kaleido") is not None)
    fig = final.figure
    assert len(fig.data) == sum(len(f.data) for f in d.figures.values())  # every figure's traces
    legends = [t.legend or "legend" for t in fig.data]
    assert list(dict.fromkeys(legends)) == ["legend", "legend2", "legend3", "legend4"]  # one per figure, in order
    assert f"{session.history[-1].loss:.4f}" in fig.layout.title.text
    tl = [t for t in fig.data if t.legend == "legend2" and t.type == "bar"]
    ax = fig.layout["yaxis" + tl[0].yaxis.removeprefix("y")]
    assert "compute" in ax.categoryarray  # the timeline's lanes survive the composition
    titles = [a.text for a in fig.layout.annotations]
    assert "step 2, lane by lane" in titles and any(t.startswith("device buffers") for t in titles)


def test_compose_keeps_axes_shapes_and_placeholders():
    a = dashboard_mod._placeholder("run history", "no steps yet")
    spans = Trace(step=0, spans=[("compute", "fwd", 0, "fwd", 0.0, 2.0, 0), ("h2d", "h2d", 1, "io", 1.0, 3.0, 0),
                                 ("compute", "fwd", 1, "fwd", 3.0, 5.0, 0)]).to_dataframe()
    b = viz.timeline(spans, stalls=find_stalls(spans))
    fig = dashboard_mod.compose([a, b], title="both")
    assert [a.text for a in fig.layout.annotations if a.text == "no steps yet"]
    (band,) = fig.layout.shapes
    assert (band.xref, band.yref) == ("x2", "y2")  # the stall band on the timeline's axes
    assert fig.layout.yaxis2.categoryarray == ("compute", "h2d") and fig.layout.xaxis2.title.text.endswith("(ms)")
    assert {t.yaxis for t in fig.data} == {"y2"}
    hist = viz.run_history(pd.DataFrame({"step": [1, 2], "loss": [2.0, 1.0], "tokens_per_s": [5.0, 6.0]}))
    both = dashboard_mod.compose([b, hist])
    assert both.layout.xaxis2.matches == "x3" and both.layout.xaxis.matches is None  # history's steps stay shared


def test_first_draw_imports_no_notebook_stack_without_anywidget():
    """Without anywidget, no go.FigureWidget probe: it would import plotly.io's nbformat / jsonschema."""
    if HAS_ANYWIDGET:
        pytest.skip("anywidget is installed: the FigureWidget backend is used")
    code = ("import sys; sys.path.insert(0, 'tests'); from conftest import make_config; "
            "from megatrain_nb import Session; from megatrain_nb.view.dashboard import Dashboard; "
            "from megatrain_nb.data import synthetic_batches; "
            "s = Session.from_config(make_config('llama'), device='cpu'); "
            "s.step(next(synthetic_batches(96, batch=2, seq=16, kind='successor', alphabet=96))); d = Dashboard(s); d.update(); "
            "print(d.backend, 'jsonschema' in sys.modules, 'nbformat' in sys.modules); s.close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["output", "False", "False"]
