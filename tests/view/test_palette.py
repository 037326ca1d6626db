"""Tests for megatrain_nb.view.palette through the figures that use it, by structure (never pixels): every
figure has a title, legends and axis ticks speak in words, and a phase has one colour in every figure.

The figures come from everything that draws a step: a recorded H200 trace, the planner's simulated
step, a fresh CPU session (what the dashboard and the report show) and the synthetic fixture.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest

from conftest import make_config
from megatrain_nb import Session
from megatrain_nb.view import palette, viz
from megatrain_nb.data import synthetic_batches
from megatrain_nb.machine.planner import plan
from megatrain_nb.view.trace import PHASES, Trace, find_stalls

DATA = Path(__file__).parents[1] / "fixtures"
SHAPE_3B = dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
HUMAN = (set(palette.PHASE_LABELS.values()) | set(palette.STATE_COLORS) | set(palette.MEMORY_LABELS.values())
         | set(palette.METRIC_LABELS.values()) | {"stalls", palette.WAIT_LABEL})


@pytest.fixture(scope="module")
def session_figures() -> dict[str, go.Figure]:
    """The four Session plots after three CPU steps (what the dashboard and report draw)."""
    s = Session.from_config(make_config("llama"), device="cpu", lr=1e-2, seed=0)
    try:
        it = synthetic_batches(96, batch=2, seq=16, kind="successor", alphabet=96)
        for _ in range(3):
            s.step(next(it))
        return {"timeline": s.plot_timeline(), "buffers": s.plot_buffers(), "memory": s.plot_memory(),
                "history": s.plot_history()}
    finally:
        s.close()


@pytest.fixture(scope="module")
def timelines(session_figures) -> dict[str, go.Figure]:
    """Timelines of every source of spans."""
    real = Trace.load(DATA / "trace_3b_cast_b4.json.gz").to_dataframe()
    sim = plan(SHAPE_3B, batch=1, seq=4096).simulate()
    synthetic = Trace.load(DATA / "synthetic_step.trace.json").to_dataframe()
    return {"recorded H200": viz.timeline(real, stalls=find_stalls(real)), "planner": viz.timeline(sim),
            "session": session_figures["timeline"], "synthetic": viz.timeline(synthetic)}


def all_figures(session_figures) -> dict[str, go.Figure]:
    real = Trace.load(DATA / "trace_3b_cast_b4.json.gz")
    synthetic = Trace.load(DATA / "synthetic_step.trace.json")
    return {**{f"session {k}": f for k, f in session_figures.items()},
            "recorded buffers": viz.buffers(real.slots_dataframe()),
            "synthetic memory": viz.memory(synthetic.counters_dataframe()),
            "history": viz.run_history(pd.DataFrame({"step": [1, 2], "loss": [2.0, 1.0], "peak_device_bytes": [1, 2],
                                                     "host_rss_bytes": [3, 4]}))}


def test_every_figure_has_a_title_saying_what_it_shows(session_figures):
    for name, fig in all_figures(session_figures).items():
        assert fig.layout.title.text and len(fig.layout.title.text) > 8, name
    assert session_figures["timeline"].layout.title.text.startswith("step 3, lane by lane")
    assert viz.timeline(Trace(step=0).to_dataframe(), title="mine").layout.title.text == "mine"


def test_legend_names_are_words_not_counter_or_column_names(session_figures):
    for name, fig in all_figures(session_figures).items():
        names = {t.name for t in fig.data}
        assert names <= HUMAN, (name, names - HUMAN)
        assert not any("_" in n for n in names), (name, names)
    mem = viz.memory(Trace(step=0, counters=[("pinned_in_use_bytes", 0.0, 1.0), ("host_rss_bytes", 0.0, 2.0),
                                             ("device_mem.weight_slots", 0.0, 3.0)]).counters_dataframe())
    assert [t.name for t in mem.data] == ["weight slots", "host RSS (whole process)", "pinned staging in use"]


def test_axis_ticks_are_words_over_the_codes(timelines, session_figures):
    fig = timelines["recorded H200"]
    ticks = dict(zip(fig.layout.yaxis.tickvals, fig.layout.yaxis.ticktext))
    assert ticks["host-adam"] == "host-adam · AdamW" and ticks["h2d"] == "h2d · weights in"
    assert set(ticks) == set(fig.layout.yaxis.categoryarray)  # every lane ticked, none invented
    buf = session_figures["buffers"]
    assert [t for t in buf.layout.yaxis.ticktext if t.startswith("weight")] == ["weight slot 0", "weight slot 1"]
    assert all(f.layout.xaxis.title.text.endswith("(ms)") for f in timelines.values())


def test_a_phase_has_one_colour_in_every_figure(timelines, session_figures):
    seen: dict[str, set] = {}
    for name, fig in timelines.items():
        bars = [t for t in fig.data if t.type == "bar" and t.legendgroup != "wait"]
        assert bars, name
        for t in bars:
            seen.setdefault(t.legendgroup, set()).add(t.marker.color)
            assert t.name == palette.PHASE_LABELS[t.legendgroup], (name, t.name)
    assert {"fwd", "loss", "bwd", "optim"} <= set(seen)
    assert seen == {p: {palette.PHASE_COLORS[p]} for p in seen}
    buf = {t.name: t.marker.color for t in session_figures["buffers"].data}
    assert buf["loading"] == palette.PHASE_COLORS["io"]  # a loading slot is a weight copy: the I/O colour


def test_a_colour_means_one_thing():
    colours = list(palette.PHASE_COLORS.values()) + [c for s, c in palette.STATE_COLORS.items() if s != "loading"]
    colours += [palette.STALL_COLOR, palette.OTHER_COLOR]
    assert len(colours) == len(set(colours))
    assert set(palette.PHASE_COLORS) == set(PHASES) == set(palette.PHASE_LABELS)


def _colour(t) -> str | None:
    """The colour a trace is drawn in: a bar's marker, a line's line (else its marker)."""
    if t.type == "bar":
        return t.marker.color
    return (t.line.color if t.line and t.line.color else None) or (t.marker.color if t.marker else None)


@pytest.fixture(scope="module")
def every_figure(session_figures, timelines) -> dict[str, go.Figure]:
    """Every kind of figure the views make: viz's four (of every source), the dashboard's four and its
    static composition, and the report's (the Session plot methods, which the report embeds)."""
    from megatrain_nb.view import dashboard

    s = Session.from_config(make_config("llama"), device="cpu", lr=1e-2, seed=0)
    try:
        it = synthetic_batches(96, batch=2, seq=16, kind="successor", alphabet=96)
        for _ in range(2):
            s.step(next(it))
        for r, v in zip(s.history, (0.1, 0.4)):
            r.metrics = {"reward_mean": v, "kl": v / 10, "clip_ratio/region_mean": v / 2}
        dash = {f"dashboard {k}": f for k, f in dashboard.figures(s).items()}
        static = dashboard.compose(list(dashboard.figures(s).values()), title="final")
    finally:
        s.close()
    real = Trace.load(DATA / "trace_3b_cast_b4.json.gz")
    synthetic = Trace.load(DATA / "synthetic_step.trace.json")
    return {**all_figures(session_figures), **timelines, **dash, "dashboard static": static,
            "recorded memory": viz.memory(real.counters_dataframe()),
            "synthetic buffers": viz.buffers(synthetic.slots_dataframe())}


def test_in_every_figure_distinct_legend_names_have_distinct_colours(every_figure):
    for name, fig in every_figure.items():
        by_legend: dict[str, dict[str, str]] = {}
        for t in fig.data:
            c = _colour(t)
            assert c, (name, t.name)  # nothing left to plotly's default cycle
            by_legend.setdefault(t.legend or "legend", {}).setdefault(t.name, c)
        for legend, colours in by_legend.items():
            assert len(set(colours.values())) == len(colours), (name, legend, colours)


def test_a_category_has_one_colour_across_every_figure(every_figure):
    seen: dict[str, set] = {}
    for name, fig in every_figure.items():
        for t in fig.data:
            seen.setdefault(t.name, set()).add(_colour(t))
    assert {n: c for n, c in seen.items() if len(c) > 1} == {}
    assert seen[palette.WAIT_LABEL] == {palette.WAIT_COLOR} and seen["stalls"] == {palette.STALL_COLOR}


def test_waits_and_stalls_are_drawn_unlike_work(timelines):
    fig = timelines["recorded H200"]
    work = {t.marker.color for t in fig.data if t.type == "bar" and t.legendgroup != "wait"}
    (wait,) = [t for t in fig.data if t.legendgroup == "wait"]
    assert wait.marker.pattern.shape == palette.WAIT_PATTERN and wait.marker.color not in work
    assert all(not t.marker.pattern.shape for t in fig.data if t.type == "bar" and t.legendgroup != "wait")
    assert palette.STALL_COLOR not in work and palette.WAIT_COLOR != palette.STALL_COLOR


def test_every_memory_category_has_its_own_colour_and_words():
    """The planner's, the store's and the counters' categories: one colour per category (label), never shared."""
    plans = [plan(SHAPE_3B, batch=4, seq=4096, **kw) for kw in ({}, {"cast_on_device": True}, {"pin_store": True})]
    keys = {k for p in plans for k in (*p.host_bytes, *p.device_bytes)} | {"weights", "grads", "resident", "activations",
                                                      "host_rss_bytes", "pinned_in_use_bytes"}
    keys |= {"master", "grad", "exp_avg", "exp_avg_sq", "shadow"}
    assert keys <= set(palette.MEMORY_COLORS) and keys <= set(palette.MEMORY_LABELS)
    by_label: dict[str, set] = {}
    for k in palette.MEMORY_COLORS:
        by_label.setdefault(palette.MEMORY_LABELS[k], set()).add(palette.MEMORY_COLORS[k])
    assert all(len(c) == 1 for c in by_label.values()), by_label  # a category's keys agree
    colours = [next(iter(c)) for c in by_label.values()]
    assert len(colours) == len(set(colours))  # and no two categories share one
    cmap = palette.color_map(sorted(keys), palette.MEMORY_LABELS, palette.MEMORY_COLORS)
    assert cmap[palette.MEMORY_LABELS["activations_kept"]] != cmap[palette.MEMORY_LABELS["master_fp32"]]
    assert cmap[palette.MEMORY_LABELS["resident_state"]] != cmap[palette.MEMORY_LABELS["head_slots"]]
    assert {"cast_stage", "pinned_copy"} <= keys  # the settings' own categories are in the check


def test_optimizer_states_have_colours_of_their_own():
    """fp32 / int8 / int4 look alike in every figure that compares them, and like nothing else."""
    import re

    used = [c.upper() for c in re.findall(r"#[0-9A-Fa-f]{6}", open(palette.__file__).read())]
    mine = [c.upper() for c in palette.STATE_PRECISION_COLORS.values()]
    assert set(palette.STATE_PRECISION_COLORS) == {"fp32", "int8", "int4"}
    assert all(used.count(c) == 1 for c in mine), "an optimizer state's colour is used elsewhere in the palette"
