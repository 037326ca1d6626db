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

from .palette import (CARRIED_COLOR, LANE_LABELS, MEMORY_COLORS, MEMORY_LABELS, METRIC_COLORS, METRIC_LABELS,
                      OTHER_COLOR, PHASE_COLORS, PHASE_LABELS, STALL_COLOR, STATE_COLORS, WAIT_COLOR, WAIT_LABEL,
                      WAIT_PATTERN, colors_for, label, layer_label, slot_label)
from .results import StepResult
from .trace import PHASES, lane_order, slot_segments

_GIB = float(1 << 30)
_SLOT_KINDS = ("weight", "grad", "pinned")


def _squeeze(t: pd.Series, early: float, band: float) -> pd.Series:
    """Times before 0 (back to `early`) squeezed into [-band, 0]; others unchanged."""
    return t.where(t >= 0, -band * t / early) if early < 0 else t


def _bars(df: pd.DataFrame, *, y: pd.Series, name: str, color: str, label_ms: float,
          early: float = 0.0, band: float = 0.0, head: int | None = None) -> go.Bar:
    """Horizontal bars from start_ms/end_ms rows, labelled with the layer when wide enough ("emb" for -1,
    "head" for `head`); times before 0 drawn squeezed into [-band, 0] (`_squeeze`; the hover keeps the real ones)."""
    start = _squeeze(df.start_ms, early, band)
    dur = _squeeze(df.end_ms, early, band) - start
    layers = [layer_label(ly, head) for ly in df.layer]
    text = [("emb" if ly == "embedding" else ly) if w >= label_ms else "" for ly, w in zip(layers, dur)]
    extra = df.op if "op" in df else df.state
    nbytes = df.bytes if "bytes" in df else pd.Series(0, index=df.index)
    return go.Bar(
        x=dur, y=y, base=start, orientation="h", name=name, marker_color=color,
        marker_line_width=0, text=text, textposition="inside", insidetextanchor="middle",
        customdata=list(zip(extra.astype(str), layers, nbytes.astype(int), df.start_ms, df.end_ms - df.start_ms)),
        hovertemplate="%{customdata[0]} · layer %{customdata[1]}<br>%{customdata[3]:.3f} ms + %{customdata[4]:.3f} ms"
                      "<br>%{customdata[2]:,} bytes<extra>%{fullData.name}</extra>")


def is_wait(spans: pd.DataFrame) -> pd.Series:
    """Which spans record a worker held rather than working (op "wait-update" and any other "wait-*")."""
    return spans.op.astype(str).str.startswith("wait")


def timeline(spans: pd.DataFrame, *, stalls: pd.DataFrame | None = None, title: str | None = None) -> go.Figure:
    """Gantt view of a step: one row per lane, bars coloured by phase, layer numbers on wide bars.

    Args:
        spans: `Trace.to_dataframe()` or `Plan.simulate()`.
        stalls: `trace.find_stalls(spans)`; drawn as translucent bands on the compute row with the
            diagnosis on hover.
        title: figure title (default: "one step, lane by lane").

    Returns:
        A Figure with one Bar trace per phase present (PHASES order), named in words
        (`palette.PHASE_LABELS`; `legendgroup` keeps the phase), then one hatched "waiting" Bar
        (legendgroup "wait") of the spans where a worker was held (`is_wait`: not its phase's work),
        plus one "stalls" Scatter when stalls are given; y is categorical with one category per lane,
        compute on top, its ticks in words (`palette.LANE_LABELS`). Layer -1 is labelled "emb"
        (the embedding), the loss's layer "head" (the LM head, index L); the legend's title says so.
        x starts at the step's start: the time before 0 of spans that began in the step before (an
        update carried over) is squeezed into a shaded band left of 0 ("from the step before", 4% of
        the step), their hover keeping the real times.

    Example:
        >>> from megatrain_nb.view.trace import Trace
        >>> fig = timeline(Trace(step=0, spans=[("compute", "fwd", 0, "fwd", 0.0, 1.0, 0)]).to_dataframe())
        >>> [(t.name, t.legendgroup) for t in fig.data]
        [('forward', 'fwd')]
    """
    lanes = lane_order(spans.lane)
    end = float(spans.end_ms.max()) if len(spans) else 1.0
    early = float(spans.start_ms.min()) if len(spans) else 0.0
    band = 0.04 * max(end, 1e-3) if early < 0 else 0.0  # work carried over from the step before, squeezed in
    extent = end + band
    loss_layers = spans.layer[spans.phase == "loss"]
    head = int(loss_layers.max()) if len(loss_layers) else None  # the head unit's index (L), where the loss ran
    fig = go.Figure()
    waits = is_wait(spans) if len(spans) else pd.Series(False, index=spans.index)
    work = spans[~waits]
    phases = [p for p in PHASES if p in set(work.phase)] + [p for p in dict.fromkeys(work.phase) if p not in PHASES]
    for phase in phases:
        g = work[work.phase == phase]
        bars = _bars(g, y=g.lane, name=label(phase, PHASE_LABELS), color=PHASE_COLORS.get(phase, OTHER_COLOR),
                     label_ms=0.015 * extent, early=early, band=band, head=head)
        fig.add_trace(bars.update(legendgroup=phase))
    if waits.any():
        g = spans[waits]
        bars = _bars(g, y=g.lane, name=WAIT_LABEL, color=WAIT_COLOR, label_ms=0.015 * extent, early=early,
                     band=band, head=head)
        fig.add_trace(bars.update(legendgroup="wait", marker_pattern=dict(shape=WAIT_PATTERN, fgcolor=STALL_COLOR,
                                                                          fillmode="overlay", size=6)))
    if band:
        fig.add_vrect(x0=-band, x1=0, fillcolor=CARRIED_COLOR, line_width=0, layer="below",
                      annotation_text="from the step before", annotation_position="top left",
                      annotation_font_size=10)
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
                      height=130 + 45 * max(len(lanes), 1),
                      legend_title_text="part of the step<br><sub>bar text: layer (emb: embedding, head: LM head)</sub>",
                      margin=dict(l=10, r=10, t=50, b=40))
    fig.update_xaxes(title_text="time since the step began (ms)", range=[-band, extent - band])
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
        labelled with the layer held ("emb" for the embedding); x runs from the step's start (0).
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
    if len(seg):  # from the step's start, as the timeline: the first load may come well after it
        fig.update_xaxes(range=[min(0.0, float(seg.start_ms.min())), float(seg.end_ms.max())])
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


def bytes_unit(largest: float) -> tuple[str, float]:
    """("GiB", 2**30) from 1 GiB up, else ("MiB", 2**20): the unit an axis of values up to `largest` bytes reads in."""
    return ("GiB", _GIB) if largest >= _GIB else ("MiB", float(1 << 20))


def memory(counters: pd.DataFrame, *, host_bytes: dict[str, float] | None = None,
           title: str | None = None) -> go.Figure:
    """Device memory by category (stacked) and host memory over the step, each axis from 0 in GiB or MiB.

    Args:
        counters: `Trace.counters_dataframe()`; names "device_mem.<category>" go to the device
            panel, every other name (e.g. "host_rss_bytes", "pinned_in_use_bytes") to the host one.
        host_bytes: the host store's bytes by category (`Session.memory_report()`'s master, grad,
            exp_avg...): drawn stacked in the host panel, constant over the step; the host counters then
            draw as lines except "host_rss_bytes" (the whole process, mostly not the store: its peak
            goes in the panel's title, so a small store is not flattened under it).
        title: figure title (default: "memory over one step").

    Returns:
        A Figure with a device panel only when there are device counters (yaxis "y"; none on
        device="cpu") and a host panel below it (the last yaxis): one stacked Scatter per device or
        store category and one line per host counter, each named in words (`palette.MEMORY_LABELS`)
        and coloured by category (`palette.MEMORY_COLORS`); categories that are zero throughout are
        left out. Each y axis starts at 0 and reads in GiB from 1 GiB up, else in MiB (its title says which).
    """
    is_dev = counters.name.str.startswith("device_mem.")
    host = counters[~is_dev]
    store = {k: float(v) for k, v in (host_bytes or {}).items() if v}
    rss = host[host.name == "host_rss_bytes"]
    if host_bytes is not None and len(rss):
        host = host[host.name != "host_rss_bytes"]
    host = host.groupby("name").filter(lambda g: (g.value != 0).any()) if len(host) else host
    dev_wide = _step_wide(counters[is_dev]) if is_dev.any() else pd.DataFrame()
    dev_wide = dev_wide.loc[:, (dev_wide != 0).any()] if len(dev_wide) else dev_wide
    host_title = "host memory" if not store else "host memory: the store by category" + (
        f" (whole process RSS, peak {rss.value.max() / (1 << 20):,.0f} MiB)" if len(rss) else "")
    titles = (["device memory by category"] if len(dev_wide.columns) else []) + [host_title]
    fig = make_subplots(rows=len(titles), cols=1, shared_xaxes=True, vertical_spacing=0.14, subplot_titles=titles)
    row = 1
    if len(dev_wide.columns):
        unit, scale = bytes_unit(float(dev_wide.sum(axis=1).max()))
        keys = [n.removeprefix("device_mem.") for n in dev_wide.columns]
        colors = colors_for(keys, MEMORY_COLORS)
        for name, key in zip(dev_wide.columns, keys):
            fig.add_trace(go.Scatter(x=dev_wide.index, y=dev_wide[name] / scale, name=label(key, MEMORY_LABELS),
                                     stackgroup="device", mode="lines", line_shape="hv", line_color=colors[key],
                                     fillcolor=colors[key], legendgroup="device", legendgrouptitle_text=f"device ({unit})"),
                          row=1, col=1)
        fig.update_yaxes(title_text=unit, rangemode="tozero", row=1, col=1)
        row = 2
    times = counters.t_ms
    x = [float(times.min()), float(times.max())] if len(times) else [0.0, 1.0]
    largest = max([sum(store.values())] + [float(g.value.max()) for _, g in host.groupby("name")] + [0.0])
    unit, scale = bytes_unit(largest)
    colors = colors_for(list(store) + sorted(set(host.name)), MEMORY_COLORS)
    for key, v in store.items():
        fig.add_trace(go.Scatter(x=x, y=[v / scale] * 2, name=label(key, MEMORY_LABELS), stackgroup="host",
                                 mode="lines", line_shape="hv", line_color=colors[key], fillcolor=colors[key],
                                 legendgroup="host", legendgrouptitle_text=f"host ({unit})"), row=row, col=1)
    for name, g in host.groupby("name", sort=True):
        g = g.sort_values("t_ms")
        fig.add_trace(go.Scatter(x=g.t_ms, y=g.value / scale, name=label(name, MEMORY_LABELS), mode="lines",
                                 line_shape="hv", line_color=colors[name], legendgroup="host",
                                 legendgrouptitle_text=f"host ({unit})"), row=row, col=1)
    fig.update_yaxes(title_text=unit, rangemode="tozero", row=row, col=1)
    fig.update_xaxes(title_text="time since the step began (ms)", row=row, col=1)
    fig.update_layout(title=title or "memory over one step", height=300 + 240 * (row - 1),
                      margin=dict(l=10, r=10, t=70, b=40),
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


def flat_columns(history: pd.DataFrame, columns: list[str]) -> list[str]:
    """Those of `columns` that hold one value at every step of three or more (a KL at beta=0, a clip ratio
    that never clips): a panel of them says one number, which `run_history` puts in its title instead.

    Example:
        >>> flat_columns(pd.DataFrame({"kl": [0.0] * 3, "reward": [0.1, 0.3, 0.2]}), ["kl", "reward"])
        ['kl']
    """
    return [c for c in columns if history[c].notna().sum() >= 3 and history[c].nunique(dropna=True) == 1]


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
            those, one subplot per `metric_panels` group with the group's name as title and y-axis title;
            a metric with one value at every step (`flat_columns`) takes no subplot: the title says its value.
        title: figure title (default: "run history, one point per step").

    Returns:
        A Figure with one subplot per present panel (loss, tokens/s, TFLOPS, memory, then the metric
        panels), x = step; one Scatter per column, named in words (`palette.METRIC_LABELS`; a metric
        by its column name) and coloured by `palette.METRIC_COLORS` (a metric by `palette.colors_for`).

    Raises:
        ValueError: "step" is missing, or none of the metric columns is present.
    """
    if "step" not in history.columns:
        raise ValueError(f"history needs a 'step' column; it has {list(history.columns)}.")
    panels = [(t, [c for c in cols if c in history.columns], unit, k) for t, cols, unit, k in _HISTORY_PANELS]
    metrics = metric_columns(history)
    flat = flat_columns(history, metrics)
    panels = [p for p in panels if p[1]] + [(t, cols, t, 1.0) for t, cols in metric_panels(
        [c for c in metrics if c not in flat])]
    if not panels:
        raise ValueError("history has none of loss, tokens_per_s, tflops, peak_device_bytes, host_rss_bytes "
                         "and no metric column.")
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.3 / len(panels),
                        subplot_titles=[p[0] for p in panels])
    colors = colors_for([c for _, cols, _, _ in panels for c in cols], METRIC_COLORS)
    for i, (_, cols, unit, scale) in enumerate(panels, start=1):
        for c in cols:
            h = history[history[c].notna()]  # eval_loss exists only at the steps evaluated after
            fig.add_trace(go.Scatter(x=h.step, y=h[c] * scale, name=label(c, METRIC_LABELS), mode="lines+markers",
                                     line_color=colors[c], marker_color=colors[c]), row=i, col=1)
        fig.update_yaxes(title_text=unit, row=i, col=1)
    fig.update_xaxes(title_text="step", row=len(panels), col=1)
    note = ("; flat: " + ", ".join(f"{c} = {history[c].dropna().iloc[0]:.4g}" for c in flat)) if flat else ""
    fig.update_layout(title=(title or "run history, one point per step") + note, height=180 + 170 * len(panels),
                      margin=dict(l=10, r=10, t=70, b=40))
    return fig
