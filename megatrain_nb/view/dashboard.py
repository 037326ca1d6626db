"""A live ipywidgets view of a Session: headline numbers and three plotly figures, refreshed on demand.

Owns: the widget layout, replacing its figures from a session (`Dashboard.update`) and the headline
numbers (`headline`: last step, throughput, peak memory) that the dashboard header and the HTML
report share. Thin over `viz`: every figure is a Session plot method (that is, a viz function over
the session's DataFrames). Does not train or decide when to refresh: `training.train` calls
`update` between steps, throttled.
"""
from __future__ import annotations

import html
import json

import pandas as pd
import plotly.graph_objects as go

_GIB = float(1 << 30)
FIGURES = ("history", "timeline", "memory")  # dashboard figures, top to bottom
_PLOTLY_MIME = "application/vnd.plotly.v1+json"


def headline(session) -> dict:
    """The numbers of the dashboard header, from the session's history, last trace and store.

    Returns:
        dict: step, loss, tokens_per_s, tflops (None before the first step); peak_device_bytes
        (largest sum of the last trace's "device_mem.*" counters; None without CUDA counters),
        peak_host_rss_bytes (largest "host_rss_bytes" sample; None without one), host_store_bytes
        and bytes_per_param (`Session.memory_report`).
    """
    out = dict(step=None, loss=None, tokens_per_s=None, tflops=None)
    if session.history:
        r = session.history[-1]
        out.update(step=r.step, loss=r.loss, tokens_per_s=r.tokens / r.seconds, tflops=r.tflops)
    tr = session.trace
    counters = tr.counters_dataframe() if tr is not None else pd.DataFrame(columns=["name", "t_ms", "value"])
    out.update(peak_memory(counters))
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


def _header_html(h: dict) -> str:
    """One line of headline numbers as HTML."""
    items = [("step", _fmt(h["step"], "d")), ("loss", _fmt(h["loss"], ".4f")),
             ("tok/s", _fmt(h["tokens_per_s"], ",.0f")), ("TFLOPS", _fmt(h["tflops"], ".3g")),
             ("peak device", format_bytes(h["peak_device_bytes"])),
             ("peak host RSS", format_bytes(h["peak_host_rss_bytes"])),
             ("host store", f"{format_bytes(h['host_store_bytes'])} ({h['bytes_per_param']:.1f} B/param)")]
    cells = " &nbsp;·&nbsp; ".join(f"<b>{html.escape(k)}</b> {html.escape(v)}" for k, v in items)
    return f'<div class="megatrain-header" style="font-family:monospace;font-size:13px">{cells}</div>'


def _placeholder(title: str, note: str) -> go.Figure:
    """An empty figure saying why there is nothing to draw yet."""
    fig = go.Figure()
    fig.update_layout(title=title, height=160, margin=dict(l=10, r=10, t=40, b=10),
                      xaxis_visible=False, yaxis_visible=False,
                      annotations=[dict(text=note, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)])
    return fig


def _figures(session) -> dict[str, go.Figure]:
    """Fresh figures of the session for every name in FIGURES."""
    figs = {"history": session.plot_history() if session.history else _placeholder("run history", "no steps yet")}
    tr = session.trace
    if tr is None or not len(tr.spans):
        note = "no step yet" if not session.history else "tracing is off (trace=False)"
        figs.update(timeline=_placeholder("last step", note), memory=_placeholder("memory", note))
        return figs
    figs["timeline"] = session.plot_timeline()
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
    """go.FigureWidget, or None when it cannot be built (plotly >= 6 needs the anywidget package)."""
    try:
        return go.FigureWidget()
    except ImportError:
        return None


class Dashboard:
    """Live view of a Session: a header (step, loss, tok/s, TFLOPS, peak memory) over three figures
    (run history, the last step's timeline with its stalls, the last step's memory).

    Works without a frontend: it can be built and updated in a plain Python process (tests); the
    figures are then just objects. `training.train` shows one in Jupyter and calls `update`.

    Backend (`self.backend`): "figurewidget" when `go.FigureWidget` can be built, which plotly >= 6
    only can with the `anywidget` package installed; each update then replaces the figures' traces
    in place. Otherwise "output": each figure is a plain `go.Figure` shown in an `ipywidgets.Output`
    whose display is replaced by the figure's plotly JSON on every update (drawn by JupyterLab's
    plotly renderer; a zoom is lost at each refresh). `pip install anywidget` for the first.

    Args:
        session: a `Session` (any object with history, trace, memory_report and plot_* methods).

    Attributes:
        figures: name -> figure for each of FIGURES (FigureWidget or Figure), updated in place.
        header: the `ipywidgets.HTML` header.
        widget: the `ipywidgets.VBox` holding everything.

    Example:
        >>> d = Dashboard(s); d.display()        # doctest: +SKIP
        >>> s.step(batch); d.update()            # doctest: +SKIP
    """

    def __init__(self, session):
        import ipywidgets as widgets

        self.session = session
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
        self.widget = widgets.VBox([self.header, *views])
        self.update()

    def update(self) -> None:
        """Redraw the header and every figure from the session's current history and last trace.

        Reads only host-side records (no device sync); call it between steps.
        """
        for name, fig in _figures(self.session).items():
            _replace(self.figures[name], fig)
            if name in self._outputs:
                self._outputs[name].outputs = (_mimebundle(self.figures[name]),)
        self.header.value = _header_html(headline(self.session))

    def display(self) -> None:
        """Show the dashboard in the current notebook cell."""
        from IPython.display import display

        display(self.widget)

    def _ipython_display_(self) -> None:
        self.display()

    def __repr__(self) -> str:
        return f"Dashboard({self.session!r}, backend={self.backend!r})"
