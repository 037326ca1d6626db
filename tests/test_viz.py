"""Tests for megatrain_nb.view.viz: figures by structure (traces, axes, rows), never by pixels."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest

from megatrain_nb.view import palette, viz
from megatrain_nb.view.trace import Trace, find_stalls

DATA = Path(__file__).parent / "data"
GIB = float(1 << 30)


@pytest.fixture(scope="module")
def synthetic() -> Trace:
    return Trace.load(DATA / "synthetic_step.trace.json")


def small_spans() -> pd.DataFrame:
    return Trace(step=0, spans=[("compute", "fwd", 0, "fwd", 0.0, 2.0, 0), ("h2d", "h2d", 1, "io", 1.0, 3.0, 8),
                                ("compute", "bwd", 1, "bwd", 3.0, 5.0, 0),
                                ("compute", "fwd", 2, "fwd", 5.0, 5.01, 0)]).to_dataframe()


def test_timeline_one_trace_per_phase_one_row_per_lane():
    fig = viz.timeline(small_spans(), title="t")
    assert isinstance(fig, go.Figure)
    assert [t.name for t in fig.data] == ["forward", "backward", "I/O"]  # words, not phase codes
    assert [t.legendgroup for t in fig.data] == ["fwd", "bwd", "io"]
    assert all(t.type == "bar" and t.orientation == "h" for t in fig.data)
    assert fig.layout.yaxis.categoryarray == ("compute", "h2d")
    assert fig.layout.yaxis.ticktext == ("compute", "h2d · weights in")
    assert fig.layout.xaxis.title.text == "time since the step began (ms)"
    assert fig.layout.title.text == "t" and fig.layout.barmode == "overlay"
    fwd = fig.data[0]
    assert list(fwd.base) == [0.0, 5.0] and list(fwd.x) == pytest.approx([2.0, 0.01])
    assert list(fwd.text) == ["0", ""]  # the 0.01 ms bar is too narrow for a label
    assert len(fig.layout.shapes) == 0


def test_timeline_stall_bands_on_compute_row():
    spans = small_spans()
    stalls = find_stalls(spans)
    fig = viz.timeline(spans, stalls=stalls)
    assert len(fig.layout.shapes) == len(stalls) == 1
    band = fig.layout.shapes[0]
    assert (band.x0, band.x1, band.y0, band.y1, band.yref) == (2.0, 3.0, -0.5, 0.5, "y")
    assert fig.data[-1].name == "stalls" and fig.data[-1].customdata[0][0] == "h2d"


def test_timeline_of_a_plan_and_of_the_fixture(synthetic):
    df = synthetic.to_dataframe()
    fig = viz.timeline(df, stalls=find_stalls(df))
    assert fig.layout.yaxis.categoryarray == ("compute", "h2d", "d2h", "host-pack", "host-unpack", "host-adam")
    assert sum(len(t.x) for t in fig.data if t.type == "bar") == len(df)
    assert [t.legendgroup for t in fig.data if t.type == "bar"] == ["fwd", "loss", "bwd", "optim"]


def test_buffers_one_row_per_slot(synthetic):
    fig = viz.buffers(synthetic.slots_dataframe())
    rows = fig.layout.yaxis.categoryarray
    assert rows[:4] == ("weight[0]", "weight[1]", "grad[0]", "grad[1]")
    assert len(rows) == 4 + 13 and rows[-1] == "pinned[12]"
    assert {t.name for t in fig.data} == {"loading", "ready", "computing"}  # free segments are blank
    assert fig.layout.yaxis.ticktext[:3] == ("weight slot 0", "weight slot 1", "grad slot 0")
    assert fig.layout.xaxis.title.text == "time since the step began (ms)"


def test_buffers_segments_and_labels():
    slots = Trace(step=0, slots=[("grad", 0, 2, "computing", 0.0), ("grad", 0, None, "free", 4.0),
                                 ("weight", 1, 5, "loading", 1.0)]).slots_dataframe()
    fig = viz.buffers(slots, end_ms=10.0)
    assert fig.layout.yaxis.categoryarray == ("weight[1]", "grad[0]")
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["computing"].base) == [0.0] and list(by_name["computing"].x) == [4.0]
    assert list(by_name["loading"].x) == [9.0] and list(by_name["loading"].text) == ["5"]
    late = viz.buffers(Trace(step=0, slots=[("weight", 0, -1, "loading", 120.0),
                                            ("weight", 0, -1, "ready", 130.0)]).slots_dataframe())
    assert late.layout.xaxis.range == (0.0, 130.0) and list(late.data[0].text) == ["emb"]


def test_memory_two_subplots_in_gib():
    counters = Trace(step=0, counters=[("device_mem.weights", 0.0, 2 * GIB), ("device_mem.activations", 1.0, GIB),
                                       ("device_mem.activations", 3.0, 0.0), ("host_rss_bytes", 0.0, 100 * GIB),
                                       ("pinned_in_use_bytes", 2.0, GIB / 2)]).counters_dataframe()
    fig = viz.memory(counters)
    dev = [t for t in fig.data if t.yaxis == "y"]
    host = [t for t in fig.data if t.yaxis == "y2"]
    assert [t.name for t in dev] == ["activations", "weights"] and all(t.stackgroup == "device" for t in dev)
    assert [t.name for t in host] == ["host RSS (whole process)", "pinned staging in use"]
    assert list(dev[0].x) == [0.0, 1.0, 3.0]
    assert list(dev[0].y) == [0.0, 1.0, 0.0] and list(dev[1].y) == [2.0, 2.0, 2.0]  # carried forward
    assert list(host[0].y) == [100.0]
    assert [a.text for a in fig.layout.annotations] == ["device memory by category", "host memory"]
    assert fig.layout.yaxis.title.text == "GiB" and fig.layout.xaxis2.title.text == "time since the step began (ms)"
    assert fig.layout.yaxis2.title.text == "GiB" and fig.layout.yaxis2.rangemode == "tozero"


def test_memory_of_the_fixture(synthetic):
    fig = viz.memory(synthetic.counters_dataframe())
    assert {t.name for t in fig.data if t.yaxis == "y"} == {
        "activations", "embedding rows", "gradient slots", "head slots", "logits", "allocator reserve", "weight slots"}


def test_run_history_skips_missing_columns():
    hist = pd.DataFrame({"step": [0, 1, 2], "loss": [3.0, 2.5, 2.0], "tokens_per_s": [1e3, 2e3, 2e3],
                         "peak_device_bytes": [GIB, 2 * GIB, 2 * GIB]})
    fig = viz.run_history(hist)
    assert [a.text for a in fig.layout.annotations] == ["loss", "tokens/s", "memory"]
    assert [t.name for t in fig.data] == ["training loss", "tokens/s", "peak device memory"]
    assert [t.yaxis for t in fig.data] == ["y", "y2", "y3"]
    assert list(fig.data[2].y) == [1.0, 2.0, 2.0]
    assert fig.layout.xaxis3.title.text == "step"


def test_run_history_draws_metric_columns_one_trace_each_against_step():
    """A loss hook's metrics and train_grpo's reward_mean (Session.history_dataframe's metric columns) get
    panels below the step's own ones, grouped by the name before "/"; StepResult's other fields do not."""
    hist = pd.DataFrame({"step": [1, 2, 3], "loss": [0.5, 0.4, 0.3], "tokens": [64] * 3, "seconds": [1.0] * 3,
                         "lr": [1e-3] * 3, "grad_norm": [1.0] * 3, "skipped": [False] * 3,
                         "recomputed_layers": [0] * 3, "reward_mean": [0.1, 0.5, 0.75], "kl": [0.0, 0.01, 0.02],
                         "clip_ratio/low_mean": [0.0, 0.1, 0.0], "clip_ratio/region_mean": [0.0, 0.2, 0.1]})
    assert viz.metric_columns(hist) == ["reward_mean", "kl", "clip_ratio/low_mean", "clip_ratio/region_mean"]
    fig = viz.run_history(hist)
    assert [a.text for a in fig.layout.annotations] == ["loss", "reward_mean", "kl", "clip_ratio"]
    assert [t.name for t in fig.data] == ["training loss", "reward_mean", "kl", "clip_ratio/low_mean", "clip_ratio/region_mean"]
    assert [t.yaxis for t in fig.data] == ["y", "y2", "y3", "y4", "y4"]
    assert all(list(t.x) == [1, 2, 3] for t in fig.data)
    assert list(fig.data[1].y) == [0.1, 0.5, 0.75]
    assert [fig.layout[f"yaxis{i}"].title.text for i in (2, 3, 4)] == ["reward_mean", "kl", "clip_ratio"]
    assert fig.layout.xaxis4.title.text == "step" and not fig.layout.xaxis.title.text


def test_run_history_metric_panels_of_dpo_and_none_without_metrics():
    dpo = pd.DataFrame({"step": [1, 2], "loss": [0.7, 0.6], "rewards/chosen": [0.1, 0.2],
                        "rewards/margins": [0.0, 0.3], "logps/chosen": [-5.0, -4.0], "all_nan": [None, None]})
    fig = viz.run_history(dpo)
    assert [a.text for a in fig.layout.annotations] == ["loss", "rewards", "logps"]
    assert [t.name for t in fig.data] == ["training loss", "rewards/chosen", "rewards/margins", "logps/chosen"]
    plain = viz.run_history(pd.DataFrame({"step": [1, 2], "loss": [0.7, 0.6], "lr": [1e-3, 1e-3]}))
    assert [t.name for t in plain.data] == ["training loss"] and len(plain.layout.annotations) == 1
    only = viz.run_history(pd.DataFrame({"step": [1, 2], "reward_mean": [0.0, 1.0]}))  # no loss column: still drawn
    assert [t.name for t in only.data] == ["reward_mean"] and only.layout.xaxis.title.text == "step"


def test_run_history_errors_name_the_column():
    with pytest.raises(ValueError, match="'step'"):
        viz.run_history(pd.DataFrame({"loss": [1.0]}))
    with pytest.raises(ValueError, match="none of loss"):
        viz.run_history(pd.DataFrame({"step": [0]}))


def test_fixture_matches_its_generator(synthetic):
    spec = importlib.util.spec_from_file_location("make_synthetic_trace", DATA / "make_synthetic_trace.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.synthetic_trace() == synthetic, "run: PYTHONPATH=. python tests/data/make_synthetic_trace.py"


def test_timeline_draws_waits_apart_from_work_hatched():
    """A loader held for an update (op wait-update) is not its phase's work: its own hatched trace, pale red."""
    spans = Trace(step=0, spans=[("compute", "fwd", 0, "fwd", 0.0, 2.0, 0),
                                 ("host-pack", "wait-update", 1, "fwd", 0.5, 1.5, 0),
                                 ("host-pack", "pack", 1, "fwd", 1.5, 1.8, 0)]).to_dataframe()
    fig = viz.timeline(spans)
    by_group = {t.legendgroup: t for t in fig.data}
    assert set(by_group) == {"fwd", "wait"}
    assert len(by_group["fwd"].x) == 2 and len(by_group["wait"].x) == 1  # the wait is not forward's
    wait = by_group["wait"]
    assert wait.name == palette.WAIT_LABEL and wait.marker.color == palette.WAIT_COLOR
    assert wait.marker.pattern.shape == palette.WAIT_PATTERN and by_group["fwd"].marker.pattern.shape is None
    assert palette.WAIT_COLOR not in palette.PHASE_COLORS.values()


def test_timeline_starts_at_the_step_and_bands_the_carried_over_work():
    """A span begun in the step before (-850 ms) is drawn from a narrow band left of 0, not from -850."""
    spans = Trace(step=0, spans=[("host-adam", "adam", 3, "optim", -850.0, 4.0, 0),
                                 ("host-adam", "adam", 2, "optim", -850.0, -425.0, 0),
                                 ("compute", "fwd", -1, "fwd", 0.0, 10.0, 0)]).to_dataframe()
    fig = viz.timeline(spans)
    lo, hi = fig.layout.xaxis.range
    assert -1.0 < lo < 0 and hi == pytest.approx(10.0)
    optim = next(t for t in fig.data if t.legendgroup == "optim")
    assert list(optim.base) == [pytest.approx(lo)] * 2 and optim.customdata[0][3] == -850.0  # hover: the real start
    assert list(optim.x) == pytest.approx([-lo / 2, 4.0 - lo])  # squeezed in the band: -850..-425 -> lo..lo/2
    (band,) = [s for s in fig.layout.shapes if s.x1 == 0]
    assert band.x0 == pytest.approx(lo)
    assert any(a.text == "from the step before" for a in fig.layout.annotations)
    fwd = next(t for t in fig.data if t.legendgroup == "fwd")
    assert list(fwd.text) == ["emb"] and fwd.customdata[0][1] == "embedding"  # layer -1 named
    head = viz.timeline(Trace(step=0, spans=[("compute", "loss", 4, "loss", 0.0, 5.0, 0),
                                             ("h2d", "h2d", 4, "io", 0.0, 5.0, 0)]).to_dataframe())
    assert [list(t.text) for t in head.data] == [["head"], ["head"]]  # the loss's layer is the LM head
    assert "emb: embedding, head: LM head" in head.layout.legend.title.text
    plain = viz.timeline(spans[spans.start_ms >= 0])
    assert plain.layout.xaxis.range[0] == 0 and not plain.layout.shapes


def test_memory_on_the_cpu_has_no_device_panel_and_reads_the_store_in_mib_from_zero():
    counters = Trace(step=0, counters=[("host_rss_bytes", 0.0, 0.5542 * GIB), ("host_rss_bytes", 1.0, 0.5544 * GIB),
                                       ("pinned_in_use_bytes", 0.0, 0.0)]).counters_dataframe()
    store = {"master": 1 << 20, "grad": 1 << 20, "exp_avg": 1 << 20, "exp_avg_sq": 1 << 20, "shadow": 0}
    fig = viz.memory(counters, host_bytes=store)
    assert [a.text for a in fig.layout.annotations][0].startswith("host memory: the store by category (whole")
    assert {t.yaxis for t in fig.data} == {"y"} and "yaxis2" not in fig.layout  # one panel
    names = [t.name for t in fig.data]
    assert names == ["fp32 master weights", "gradients", "AdamW 1st moment", "AdamW 2nd moment"]  # no zeros, no RSS
    assert fig.layout.yaxis.title.text == "MiB" and fig.layout.yaxis.rangemode == "tozero"
    assert {t.legendgrouptitle.text for t in fig.data} == {"host (MiB)"}  # the legend says the unit too
    assert sum(t.y[0] for t in fig.data) == pytest.approx(4.0)
    plain = viz.memory(counters)  # without the store: RSS as a line, still from 0
    assert [t.name for t in plain.data] == ["host RSS (whole process)"] and plain.layout.yaxis.rangemode == "tozero"


def test_memory_drops_categories_that_stay_zero():
    counters = Trace(step=0, counters=[("device_mem.weights", 0.0, 2 * GIB), ("device_mem.resident", 0.0, 0.0),
                                       ("host_rss_bytes", 0.0, GIB)]).counters_dataframe()
    assert [t.name for t in viz.memory(counters).data] == ["weights", "host RSS (whole process)"]


def test_run_history_gives_a_flat_metric_no_row_and_names_its_value():
    hist = pd.DataFrame({"step": [1, 2, 3], "loss": [0.5, 0.4, 0.3], "reward_mean": [0.1, 0.5, 0.75],
                         "kl": [0.0, 0.0, 0.0]})
    fig = viz.run_history(hist)
    assert [t.name for t in fig.data] == ["training loss", "reward_mean"]
    assert [t.yaxis for t in fig.data] == ["y", "y2"]  # the reward on its own axis, not the loss's
    assert "kl = 0" in fig.layout.title.text
    assert len({t.line.color for t in fig.data}) == 2
