"""Pure functions DataFrame -> plotly Figure for traces, buffers, memory and run history.

This module owns the pictures only: every function takes the DataFrames of `trace.py` (or
`Plan.simulate()`, or a run-history table) and returns a `go.Figure`. It never calls `.show()`,
never computes analysis itself (stalls come from `trace.find_stalls`) and keeps no state, so
notebooks and the dashboard can call it on every update. Colours and the words a reader sees
(legend entries, axis ticks) come from `palette`, so a phase looks the same in every figure; every
figure has a title saying what it shows.
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .palette import (LANE_LABELS, MEMORY_LABELS, METRIC_LABELS, OTHER_COLOR, PHASE_COLORS, PHASE_LABELS,
                      STALL_COLOR, STATE_COLORS, label, slot_label)
from .results import StepResult
from .trace import PHASES, lane_order, slot_segments

_GIB = float(1 << 30)
_SLOT_KINDS = ("weight", "grad", "pinned")


def _bars(df: pd.DataFrame, *, y: pd.Series, name: str, color: str, label_ms: float) -> go.Bar:
    """Horizontal bars from start_ms/end_ms rows, labelled with the layer when wide enough."""
    dur = df.end_ms - df.start_ms
    text = [str(ly) if w >= label_ms else "" for ly, w in zip(df.layer, dur)]
    extra = df.op if "op" in df else df.state
    nbytes = df.bytes if "bytes" in df else pd.Series(0, index=df.index)
    return go.Bar(
        x=dur, y=y, base=df.start_ms, orientation="h", name=name, marker_color=color,
        marker_line_width=0, text=text, textposition="inside", insidetextanchor="middle",
        customdata=list(zip(extra.astype(str), df.layer.astype(str), nbytes.astype(int), df.start_ms)),
        hovertemplate="%{customdata[0]} · layer %{customdata[1]}<br>%{customdata[3]:.3f} ms + %{x:.3f} ms"
                      "<br>%{customdata[2]:,} bytes<extra>%{fullData.name}</extra>")


def timeline(spans: pd.DataFrame, *, stalls: pd.DataFrame | None = None, title: str | None = None) -> go.Figure:
    """Gantt view of a step: one row per lane, bars coloured by phase, layer numbers on wide bars.

    Args:
        spans: `Trace.to_dataframe()` or `Plan.simulate()`.
        stalls: `trace.find_stalls(spans)`; drawn as translucent bands on the compute row with the
            diagnosis on hover.
        title: figure title (default: "one step, lane by lane").

    Returns:
        A Figure with one Bar trace per phase present (PHASES order), named in words
        (`palette.PHASE_LABELS`; `legendgroup` keeps the phase), plus one "stalls" Scatter when
        stalls are given; y is categorical with one category per lane, compute on top, its ticks
        in words (`palette.LANE_LABELS`).

    Example:
        >>> from megatrain_nb.view.trace import Trace
        >>> fig = timeline(Trace(step=0, spans=[("compute", "fwd", 0, "fwd", 0.0, 1.0, 0)]).to_dataframe())
        >>> [(t.name, t.legendgroup) for t in fig.data]
        [('forward', 'fwd')]
    """
    lanes = lane_order(spans.lane)
    extent = float(spans.end_ms.max() - min(0.0, spans.start_ms.min())) if len(spans) else 1.0
    fig = go.Figure()
    phases = [p for p in PHASES if p in set(spans.phase)] + [p for p in dict.fromkeys(spans.phase) if p not in PHASES]
    for phase in phases:
        g = spans[spans.phase == phase]
        bars = _bars(g, y=g.lane, name=label(phase, PHASE_LABELS), color=PHASE_COLORS.get(phase, OTHER_COLOR),
                     label_ms=0.015 * extent)
        fig.add_trace(bars.update(legendgroup=phase))
    if stalls is not None and len(stalls):
        row = lanes.index("compute") if "compute" in lanes else None
        for s in stalls.itertuples(index=False):
            fig.add_shape(type="rect", x0=s.start_ms, x1=s.end_ms, xref="x", fillcolor="rgba(214,39,40,0.25)",
                          line_width=0, layer="below",
                          **(dict(yref="y", y0=row - 0.5, y1=row + 0.5) if row is not None
                             else dict(yref="paper", y0=0, y1=1)))
        fig.add_trace(go.Scatter(
            x=(stalls.start_ms + stalls.end_ms) / 2, y=["compute"] * len(stalls), mode="markers", name="stalls",
            marker=dict(symbol="line-ns-open", color=STALL_COLOR, size=10),
            customdata=list(zip(stalls.waited_on, stalls.diagnosis, stalls.setting, stalls.dur_ms)),
            hovertemplate="stall %{customdata[3]:.3f} ms, waited on %{customdata[0]}<br>%{customdata[1]}"
                          "<br>setting: %{customdata[2]}<extra></extra>"))
    fig.update_layout(title=title or "one step, lane by lane", barmode="overlay", bargap=0.25,
                      height=130 + 45 * max(len(lanes), 1), legend_title_text="part of the step",
                      margin=dict(l=10, r=10, t=50, b=40))
    fig.update_xaxes(title_text="time since the step began (ms)")
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=lanes, autorange="reversed",
                     tickvals=lanes, ticktext=[label(ln, LANE_LABELS) for ln in lanes])
    return fig


def buffers(slots: pd.DataFrame, *, end_ms: float | None = None, title: str | None = None) -> go.Figure:
    """Occupancy of device weight/grad slots and pinned buffers over time.

    Args:
        slots: `Trace.slots_dataframe()`.
        end_ms: where the last state of each slot ends (default: the last change).
        title: figure title (default: "device buffers: the layer each slot holds").

    Returns:
        A Figure with one Bar trace per non-free state; y has one category per "kind[index]",
        weight slots first, then grad, then pinned, ticked in words ("weight slot 0"); bars are
        labelled with the layer held.
    """
    seg = slot_segments(slots, end_ms=end_ms)
    kinds = [k for k in _SLOT_KINDS if k in set(seg.kind)] + sorted(set(seg.kind) - set(_SLOT_KINDS))
    slots_present = [(k, i) for k in kinds for i in sorted(set(seg[seg.kind == k]["index"]))]
    rows = [f"{k}[{i}]" for k, i in slots_present]
    seg = seg.assign(row=[f"{k}[{i}]" for k, i in zip(seg.kind, seg["index"])],
                     layer=[("" if pd.isna(ly) else int(ly)) for ly in seg.layer])
    extent = float(seg.end_ms.max() - seg.start_ms.min()) if len(seg) else 1.0
    fig = go.Figure()
    for state in [s for s in STATE_COLORS if s != "free"] + sorted(set(seg.state) - set(STATE_COLORS)):
        g = seg[seg.state == state]
        if len(g):
            fig.add_trace(_bars(g, y=g.row, name=state, color=STATE_COLORS.get(state, OTHER_COLOR),
                                label_ms=0.015 * extent))
    fig.update_layout(title=title or "device buffers: the layer each slot holds", barmode="overlay", bargap=0.25,
                      height=150 + 30 * max(len(rows), 1), legend_title_text="slot state",
                      margin=dict(l=10, r=10, t=50, b=40))
    fig.update_xaxes(title_text="time since the step began (ms)")
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=rows, autorange="reversed",
                     tickvals=rows, ticktext=[slot_label(k, i) for k, i in slots_present])
    if not len(seg):  # say why the chart is blank rather than draw an empty grid
        fig.add_annotation(text="no slot records in this trace (traces recorded before 2026-11-29 "
                                "lack them; a new step's s.trace has them)", showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


def _step_wide(counters: pd.DataFrame) -> pd.DataFrame:
    """Counters as a step function: index t_ms, one column per name, last value carried forward."""
    wide = counters.pivot_table(index="t_ms", columns="name", values="value", aggfunc="last")
    return wide.sort_index().ffill().fillna(0.0)


def memory(counters: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Device memory by category (stacked) and host memory over the step, in GiB.

    Args:
        counters: `Trace.counters_dataframe()`; names "device_mem.<category>" go to the device
            subplot, every other name (e.g. "host_rss_bytes", "pinned_in_use_bytes") to the host one.
        title: figure title (default: "memory over one step").

    Returns:
        A Figure with two subplots sharing x: row 1 one stacked Scatter per device category
        (yaxis "y"), row 2 one line per host counter (yaxis "y2"); each named in words
        (`palette.MEMORY_LABELS`: "pinned staging in use", not "pinned_in_use_bytes").
    """
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("device memory by category", "host memory"))
    is_dev = counters.name.str.startswith("device_mem.")
    if is_dev.any():
        wide = _step_wide(counters[is_dev])
        for name in wide.columns:
            fig.add_trace(go.Scatter(x=wide.index, y=wide[name] / _GIB,
                                     name=label(name.removeprefix("device_mem."), MEMORY_LABELS),
                                     stackgroup="device", mode="lines", line_shape="hv", legendgroup="device",
                                     legendgrouptitle_text="device"),
                          row=1, col=1)
    else:  # say why the panel is blank
        fig.add_annotation(text="no device counters: on device='cpu' every buffer is host memory (below)",
                           showarrow=False, xref="paper", yref="paper", x=0.5, y=0.8)  # the upper panel
    for name, g in counters[~is_dev].groupby("name", sort=True):
        g = g.sort_values("t_ms")
        fig.add_trace(go.Scatter(x=g.t_ms, y=g.value / _GIB, name=label(name, MEMORY_LABELS), mode="lines",
                                 line_shape="hv", legendgroup="host", legendgrouptitle_text="host"), row=2, col=1)
    fig.update_yaxes(title_text="GiB", row=1, col=1)
    fig.update_yaxes(title_text="GiB", row=2, col=1)
    fig.update_xaxes(title_text="time since the step began (ms)", row=2, col=1)
    fig.update_layout(title=title or "memory over one step", height=540, margin=dict(l=10, r=10, t=70, b=40),
                      legend_groupclick="toggleitem", showlegend=True)  # named even when one line is drawn
    return fig


_HISTORY_PANELS = (("loss", ("loss", "eval_loss"), "loss", 1.0), ("tokens/s", ("tokens_per_s",), "tokens/s", 1.0),
                   ("TFLOPS", ("tflops",), "TFLOP/s", 1.0),
                   ("memory", ("peak_device_bytes", "host_rss_bytes"), "GiB", 1 / _GIB))


# the columns of a run history that are not a loss hook's (or a trainer's) metrics: StepResult's fields,
# the ones Session.history_dataframe derives, and run_history's own panels
_STEP_COLUMNS = frozenset({f.name for f in dataclasses.fields(StepResult)} - {"metrics"}
                          | {c for _, cols, _, _ in _HISTORY_PANELS for c in cols})


def metric_columns(history: pd.DataFrame) -> list[str]:
    """The metric columns of a run history, in column order: the numeric columns that are not a step's
    own numbers (`StepResult`'s fields, tokens_per_s, eval_loss, memory), that is what a loss hook logged
    (`StepResult.metrics`: kl, clip_ratio/region_mean, rewards/margins...) and what a trainer recorded
    (train_grpo's reward_mean); columns with no value at all are left out.

    Example:
        >>> metric_columns(pd.DataFrame({"step": [1], "loss": [2.0], "kl": [0.1], "rewards/margins": [0.3]}))
        ['kl', 'rewards/margins']
    """
    return [c for c in history.columns if c not in _STEP_COLUMNS and pd.api.types.is_numeric_dtype(history[c])
            and not pd.api.types.is_bool_dtype(history[c]) and history[c].notna().any()]


def metric_panels(columns: list[str]) -> list[tuple[str, list[str]]]:
    """Metric columns grouped into panels by the part of their name before the first "/" (TRL's
    naming: "rewards/chosen" and "rewards/margins" share the "rewards" panel), in order of first appearance.

    Example:
        >>> metric_panels(["reward_mean", "clip_ratio/low_mean", "clip_ratio/region_mean"])
        [('reward_mean', ['reward_mean']), ('clip_ratio', ['clip_ratio/low_mean', 'clip_ratio/region_mean'])]
    """
    panels: dict[str, list[str]] = {}
    for c in columns:
        panels.setdefault(c.split("/", 1)[0], []).append(c)
    return list(panels.items())


def run_history(history: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """Per-step metrics over a run, one subplot per metric present.

    Args:
        history: one row per step; column "step" plus any of loss, eval_loss (drawn with loss,
            at the steps that have one), tokens_per_s, tflops, peak_device_bytes, host_rss_bytes (missing
            ones are skipped; the two byte columns share the "memory" subplot, in GiB), and any metric
            columns (`metric_columns`: a loss hook's metrics, train_grpo's reward_mean), drawn below
            those, one subplot per `metric_panels` group with the group's name as title and y-axis title.
        title: figure title (default: "run history, one point per step").

    Returns:
        A Figure with one subplot per present panel (loss, tokens/s, TFLOPS, memory, then the metric
        panels), x = step; one Scatter per column, named in words (`palette.METRIC_LABELS`; a metric
        by its column name).

    Raises:
        ValueError: "step" is missing, or none of the metric columns is present.
    """
    if "step" not in history.columns:
        raise ValueError(f"history needs a 'step' column; it has {list(history.columns)}.")
    panels = [(t, [c for c in cols if c in history.columns], unit, k) for t, cols, unit, k in _HISTORY_PANELS]
    panels = [p for p in panels if p[1]] + [(t, cols, t, 1.0) for t, cols in metric_panels(metric_columns(history))]
    if not panels:
        raise ValueError("history has none of loss, tokens_per_s, tflops, peak_device_bytes, host_rss_bytes "
                         "and no metric column.")
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[p[0] for p in panels])
    for i, (_, cols, unit, scale) in enumerate(panels, start=1):
        for c in cols:
            h = history[history[c].notna()]  # eval_loss exists only at the steps evaluated after
            fig.add_trace(go.Scatter(x=h.step, y=h[c] * scale, name=label(c, METRIC_LABELS), mode="lines+markers"),
                          row=i, col=1)
        fig.update_yaxes(title_text=unit, row=i, col=1)
    fig.update_xaxes(title_text="step", row=len(panels), col=1)
    fig.update_layout(title=title or "run history, one point per step", height=180 + 170 * len(panels),
                      margin=dict(l=10, r=10, t=70, b=40))
    return fig
