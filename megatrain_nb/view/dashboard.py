"""A live ipywidgets view of a Session: a header of numbers over four plotly figures, refreshed on demand, and
the static figure that replaces it when training ends.

Owns: the widget layout, replacing its figures from a session (`Dashboard.update`), the headline numbers
(`headline`: steps, loss, throughput, memory peaks, the step's stalls) that the dashboard header and the
HTML report share, and the final picture (`Dashboard.finish`: one plotly figure, `compose`d of the four,
put in place of the widget so a saved notebook shows it after a reload, in nbviewer and on GitHub).
Thin over `viz`: every figure is a Session plot method (that is, a viz function over the session's
DataFrames). Does not train or decide when to refresh: `training.train` calls `update` between steps,
throttled, and `finish` after the last.
"""
from __future__ import annotations

import html
import importlib.util
import json

import pandas as pd
import plotly.graph_objects as go

from .trace import find_stalls

_GIB = float(1 << 30)
FIGURES = ("history", "timeline", "buffers", "memory")  # dashboard figures, top to bottom
_PLOTLY_MIME = "application/vnd.plotly.v1+json"


def headline(session, bar=None) -> dict:
    """The numbers of the dashboard header, from the session's history, last trace and store.

    Args:
        session: a `Session`.
        bar: the run's progress bar (a tqdm), for the steps of this run; None: not known.
    Returns:
        dict: step (the session's last step), run_done and run_total (this run's steps, None without
        `bar`), loss, tokens_per_s, tflops (None before the first step); peak_device_bytes (largest sum
        of the last trace's "device_mem.*" counters; None without CUDA counters), peak_host_rss_bytes
        (largest "host_rss_bytes" sample; None without one), stall_ms and stall_cause (the last step's
        compute stalls, in ms, and what the longest share of them waited on; None without a trace),
        host_store_bytes and bytes_per_param (`Session.memory_report`).
    Example:
        >>> headline(s)["stall_cause"]          # doctest: +SKIP
        'h2d'
    """
    out = dict(step=None, run_done=None, run_total=None, loss=None, tokens_per_s=None, tflops=None,
               stall_ms=None, stall_cause=None)
    if bar is not None:
        out.update(run_done=int(bar.n), run_total=bar.total)
    if session.history:
        r = session.history[-1]
        out.update(step=r.step, loss=r.loss, tokens_per_s=r.tokens / r.seconds, tflops=r.tflops)
    tr = session.trace
    counters = tr.counters_dataframe() if tr is not None else pd.DataFrame(columns=["name", "t_ms", "value"])
    out.update(peak_memory(counters))
    if tr is not None and len(tr.spans):
        stalls = find_stalls(tr.to_dataframe())
        out["stall_ms"] = float(stalls.dur_ms.sum())
        if len(stalls):
            out["stall_cause"] = str(stalls.groupby("waited_on").dur_ms.sum().idxmax())
    rep = session.memory_report()
    out.update(host_store_bytes=rep["total"], bytes_per_param=rep["bytes_per_param"])
    return out


def peak_memory(counters: pd.DataFrame) -> dict:
    """Peaks of a `Trace.counters_dataframe()`: peak_device_bytes (largest sum of the "device_mem.*"
    counters, each carried forward) and peak_host_rss_bytes; None where the counters are absent."""
    dev = counters[counters.name.str.startswith("device_mem.")]
    peak_dev = None
    if len(dev):
        wide = dev.pivot_table(index="t_ms", columns="name", values="value", aggfunc="last").sort_index().ffill()
        peak_dev = float(wide.fillna(0.0).sum(axis=1).max())
    rss = counters[counters.name == "host_rss_bytes"]
    return {"peak_device_bytes": peak_dev, "peak_host_rss_bytes": float(rss.value.max()) if len(rss) else None}


def _fmt(v, spec: str) -> str:
    return "–" if v is None else f"{v:{spec}}"


def format_bytes(b: float | None) -> str:
    """'1.23 GiB' from 1 GiB up, else '12.3 MiB'; '–' for None."""
    if b is None:
        return "–"
    return f"{b / _GIB:.2f} GiB" if b >= _GIB else f"{b / (1 << 20):.1f} MiB"


def header_items(h: dict) -> list[tuple[str, str]]:
    """The header as (name, value) words, from `headline`: what the live header and the static title say."""
    step = _fmt(h["step"], "d")
    if h["run_total"] is not None:
        step = f"{h['run_done']} of {h['run_total']} this run · session step {step}"
    stall = "–" if h["stall_ms"] is None else f"{h['stall_ms']:.3g} ms" + (
        f" (mostly {h['stall_cause']})" if h["stall_cause"] else "")
    return [("step", step), ("loss", _fmt(h["loss"], ".4f")), ("tokens/s", _fmt(h["tokens_per_s"], ",.0f")),
            ("model TFLOPS", _fmt(h["tflops"], ".3g")), ("device peak", format_bytes(h["peak_device_bytes"])),
            ("host RSS", format_bytes(h["peak_host_rss_bytes"])),
            ("host store", f"{format_bytes(h['host_store_bytes'])} ({h['bytes_per_param']:.1f} B/param)"),
            ("stalls", stall)]


def _header_html(h: dict) -> str:
    """One line of headline numbers as HTML."""
    cells = " &nbsp;·&nbsp; ".join(f"<b>{html.escape(k)}</b> {html.escape(v)}" for k, v in header_items(h))
    return f'<div class="megatrain-header" style="font-family:monospace;font-size:13px">{cells}</div>'


def _placeholder(title: str, note: str) -> go.Figure:
    """An empty figure saying why there is nothing to draw yet."""
    fig = go.Figure()
    fig.update_layout(title=title, height=160, margin=dict(l=10, r=10, t=40, b=10),
                      xaxis_visible=False, yaxis_visible=False,
                      annotations=[dict(text=note, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)])
    return fig


def figures(session) -> dict[str, go.Figure]:
    """Fresh figures of the session for every name in FIGURES (a placeholder saying why where there is none).

    Example:
        >>> list(figures(s))          # doctest: +SKIP
        ['history', 'timeline', 'buffers', 'memory']
    """
    figs = {"history": session.plot_history() if session.history else _placeholder("run history", "no steps yet")}
    tr = session.trace
    if tr is None or not len(tr.spans):
        note = "no step yet" if not session.history else "tracing is off (trace=False)"
        figs.update(timeline=_placeholder("the last step, lane by lane", note),
                    buffers=_placeholder("device buffers", note), memory=_placeholder("memory", note))
        return figs
    figs["timeline"] = session.plot_timeline()
    figs["buffers"] = (session.plot_buffers() if len(tr.slots)
                       else _placeholder("device buffers", "the last step recorded no slot occupancy"))
    figs["memory"] = (session.plot_memory() if len(tr.counters)
                      else _placeholder("memory", "the last step recorded no memory counters"))
    return figs


def _replace(target: go.Figure, new: go.Figure) -> None:
    """Put `new`'s traces and layout into `target` (a FigureWidget or a Figure), as one batched change."""
    with target.batch_update():
        target.data = []
        target.add_traces(list(new.data))
        target.layout = new.layout


def _mimebundle(fig: go.Figure) -> dict:
    """An Output widget's display_data for `fig` (what JupyterLab's plotly renderer draws)."""
    return {"output_type": "display_data", "metadata": {},
            "data": {_PLOTLY_MIME: json.loads(fig.to_json()), "text/plain": f"<plotly figure: {len(fig.data)} traces>"}}


def _figure_widget():
    """go.FigureWidget, or None without the anywidget package (plotly >= 6 needs it; probing for it without
    would import plotly.io's notebook stack, a second's delay, only to fail)."""
    if importlib.util.find_spec("anywidget") is None:
        return None
    try:
        return go.FigureWidget()
    except ImportError:
        return None


_AXIS_DROP = ("domain", "anchor", "matches", "scaleanchor", "overlaying", "position")


def _ref(ref, axes: dict[str, str], first: str):
    """A shape's or annotation's x/y ref in the composed figure: its axis renamed; 'paper' the block's domain."""
    if ref is None or ref == "paper":
        return f"{first} domain"
    name, _, rest = str(ref).partition(" ")
    return f"{axes.get(name, name)}{(' ' + rest) if rest else ''}"


def compose(figs: list[go.Figure], *, title: str = "") -> go.Figure:
    """One figure of several, stacked top to bottom: each keeps its subplots (axes, their ticks and ranges),
    shapes, notes and its own legend beside it; each subplot's title is the figure's title (and the subplot's).

    Args:
        figs: figures from `viz` (or placeholders), each from `go.Figure` or `make_subplots`, one column.
        title: the composed figure's title.
    Returns:
        A Figure with one row per subplot of the inputs, in order, and one legend per input figure
        ("legend", "legend2", ...), each trace in its figure's.
    Example:
        >>> fig = compose([s.plot_history(), s.plot_timeline()], title="run")   # doctest: +SKIP
    """
    from plotly.subplots import make_subplots

    blocks = []
    for fig in figs:
        lay = fig.layout.to_plotly_json()
        ys = sorted([k for k in lay if k.startswith("yaxis")] or ["yaxis"],
                    key=lambda k: -(lay.get(k, {}).get("domain") or [0, 1])[1])
        subs = [a for a in lay.get("annotations", []) if a.get("xref") == "paper" and a.get("yref") == "paper"
                and a.get("yanchor") == "bottom" and a.get("xanchor") == "center"]
        name = (lay.get("title") or {}).get("text") or ""
        rows = [" · ".join(t for t in (name if i == 0 else "", subs[i]["text"] if i < len(subs) else "") if t)
                for i in range(len(ys))]  # the figure's title on its first subplot, then each subplot's own
        blocks.append((fig, lay, ys, subs, rows, float(lay.get("height") or 400)))
    n = sum(len(b[2]) for b in blocks)
    heights = [h / len(ys) for _, _, ys, _, _, h in blocks for _ in ys]
    out = make_subplots(rows=max(n, 1), cols=1, row_heights=heights, vertical_spacing=min(0.3 / max(n, 1), 0.04),
                        subplot_titles=[r for b in blocks for r in b[4]])
    row = 1
    for b, (fig, lay, ys, subs, _, _) in enumerate(blocks):
        axes = {}
        for k, y in enumerate(ys):
            suffix = "" if row + k == 1 else str(row + k)
            axes[y.replace("axis", "")] = f"y{suffix}"
            x = "x" + y.removeprefix("yaxis")
            axes[x] = f"x{suffix}"
            for src, dst in ((y, f"yaxis{suffix}"), ("xaxis" + y.removeprefix("yaxis"), f"xaxis{suffix}")):
                props = {p: v for p, v in lay.get(src, {}).items() if p not in _AXIS_DROP}
                if "matches" in lay.get(src, {}):  # shared axes stay shared (history's steps)
                    props["matches"] = lay[src]["matches"]
                out.layout[dst].update(props)
        for k in range(len(ys)):  # a shared axis names its partner by its old name
            for ax in (f"xaxis{'' if row + k == 1 else row + k}", f"yaxis{'' if row + k == 1 else row + k}"):
                if out.layout[ax].matches:
                    out.layout[ax].matches = axes.get(out.layout[ax].matches)
        first_x, first_y = axes["x" + ys[0].removeprefix("yaxis")], axes[ys[0].replace("axis", "")]
        legend = "legend" if b == 0 else f"legend{b + 1}"
        for t in fig.data:
            t = go.Figure(t).data[0]  # a copy
            t.update(xaxis=axes.get(t.xaxis or "x", first_x), yaxis=axes.get(t.yaxis or "y", first_y), legend=legend)
            out.add_trace(t)
        for s in lay.get("shapes", []):
            out.add_shape({**s, "xref": _ref(s.get("xref"), axes, first_x),
                           "yref": _ref(s.get("yref"), axes, first_y)})
        for a in lay.get("annotations", []):
            if a not in subs:
                out.add_annotation({**a, "xref": _ref(a.get("xref"), axes, first_x),
                                    "yref": _ref(a.get("yref"), axes, first_y)})
        top = out.layout[f"yaxis{'' if row == 1 else row}"].domain[1]
        out.layout[legend] = dict(y=top, yanchor="top", x=1.02, xanchor="left", groupclick="toggleitem",
                                  title_text=(lay.get("legend") or {}).get("title", {}).get("text"))
        row += len(ys)
    out.update_layout(title=title, height=int(sum(b[5] for b in blocks) + 80), barmode="overlay",
                      margin=dict(l=10, r=10, t=90, b=40), showlegend=True)
    return out


class StaticDashboard:
    """The final dashboard as plain output: one composed plotly figure under a header, which Jupyter saves
    with the notebook (no widget state needed to show it again).

    `_repr_mimebundle_` gives the figure's plotly JSON (JupyterLab draws it, after a reload too), HTML
    (header and figure, plotly.js from its CDN: nbviewer) and a PNG when kaleido can write one (GitHub's
    viewer shows images, not scripts).

    Attributes:
        figure: the composed `go.Figure` (`compose` of the dashboard's figures, the header in its title).
        header: the header's HTML.
    """

    def __init__(self, figure: go.Figure, header: str):
        self.figure, self.header = figure, header

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        import plotly.io as pio

        bundle = {_PLOTLY_MIME: json.loads(self.figure.to_json()),
                  "text/html": self.header + pio.to_html(self.figure, include_plotlyjs="cdn", full_html=False),
                  "text/plain": f"<megatrain dashboard: {self.figure.layout.title.text}>"}
        if importlib.util.find_spec("kaleido") is not None:
            try:
                bundle["image/png"] = self.figure.to_image(format="png", width=1100)
            except Exception:  # kaleido present but unable (no Chrome): the HTML and JSON still show
                pass
        return bundle


class Dashboard:
    """Live view of a Session: a header (this run's and the session's step, loss, tokens/s, model TFLOPS,
    device peak, host RSS, the step's stalls and their main cause) with the run's progress bar, over four
    figures: run history, the last step's timeline with its stalls, its buffer occupancy (the layer
    each weight / grad slot holds) and its memory by category.

    Works without a frontend: it can be built and updated in a plain Python process (tests); the
    figures are then just objects. `training.train` shows one in Jupyter, calls `update` and, at the
    end, `finish`, which replaces the widget by a `StaticDashboard` in the cell's output.

    Backend (`self.backend`): "figurewidget" when the `anywidget` package is installed (plotly >= 6
    needs it for `go.FigureWidget`); each update then replaces the figures' traces in place.
    Otherwise "output": each figure is a plain `go.Figure` shown in an `ipywidgets.Output` whose
    display is replaced by the figure's plotly JSON on every update (drawn by JupyterLab's plotly
    renderer; a zoom is lost at each refresh). `pip install anywidget` for the first.

    Args:
        session: a `Session` (any object with history, trace, memory_report and plot_* methods).

    Attributes:
        figures: name -> figure for each of FIGURES: a FigureWidget updated in place, or the latest Figure.
        header: the `ipywidgets.HTML` header.
        bar: the run's progress bar (set by `attach_bar`), read by the header; None: none.
        widget: the `ipywidgets.VBox` holding everything.

    Example:
        >>> d = Dashboard(s); d.display()        # doctest: +SKIP
        >>> s.step(batch); d.update(); d.finish()   # doctest: +SKIP
    """

    def __init__(self, session):
        import ipywidgets as widgets

        self.session, self.bar, self._handle = session, None, None
        first = _figure_widget()
        self.backend = "output" if first is None else "figurewidget"
        if first is None:
            self.figures = {name: go.Figure() for name in FIGURES}
            self._outputs = {name: widgets.Output() for name in FIGURES}
            views = [self._outputs[name] for name in FIGURES]
        else:
            self.figures = {name: first if i == 0 else go.FigureWidget() for i, name in enumerate(FIGURES)}
            self._outputs = {}
            views = [self.figures[name] for name in FIGURES]
        self.header = widgets.HTML()
        self._progress = widgets.Box()  # the run's bar, right under the header
        self.widget = widgets.VBox([self.header, self._progress, *views])
        self.update()

    def attach_bar(self, bar) -> None:
        """Show `bar` (a tqdm; a notebook one's widget is placed under the header) and count its steps."""
        self.bar = bar
        container = getattr(bar, "container", None)
        if container is not None:
            self._progress.children = (container,)

    def update(self) -> None:
        """Redraw the header and every figure from the session's current history and last trace.

        Reads only host-side records (no device sync); call it between steps.
        """
        for name, fig in figures(self.session).items():
            if name in self._outputs:  # a plain figure: take the new one (copying it in would cost as much again)
                self.figures[name] = fig
                self._outputs[name].outputs = (_mimebundle(fig),)
            else:
                _replace(self.figures[name], fig)
        self.header.value = _header_html(headline(self.session, self.bar))

    def static(self) -> StaticDashboard:
        """The dashboard as it stands, as plain output: the figures `compose`d, the header in the title."""
        h = headline(self.session, self.bar)
        words = [f"<b>{html.escape(k)}</b> {html.escape(v)}" for k, v in header_items(h)]
        title = "megatrain dashboard<br><span style='font-size:12px'>" + " · ".join(words[:4]) + "<br>" + \
                " · ".join(words[4:]) + "</span>"
        return StaticDashboard(compose([figures(self.session)[n] for n in FIGURES], title=title), _header_html(h))

    def finish(self) -> StaticDashboard:
        """Redraw once more and replace the live widget (where it was displayed) by `static()`, so the saved
        notebook shows the final dashboard without widget state.

        Returns:
            The `StaticDashboard` shown.
        """
        self.update()
        final = self.static()
        if self._handle is not None:
            self._handle.update(final)
            self.widget.close()
        return final

    def display(self) -> None:
        """Show the dashboard in the current notebook cell (one display that `finish` later replaces)."""
        from IPython.display import display

        self._handle = display(self.widget, display_id=True)

    def _ipython_display_(self) -> None:
        self.display()

    def __repr__(self) -> str:
        return f"Dashboard({self.session!r}, backend={self.backend!r})"
