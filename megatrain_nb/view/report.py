"""One standalone HTML page of a training run: figures, stalls, memory, settings and the last steps.

Owns: laying out a report page from a Session (`write_report`, bound as `Session.report`). The
figures come from the Session's plot methods (viz), the stalls from `trace.find_stalls`, the
headline numbers from `dashboard.headline`; this module only arranges them. The page embeds
plotly.js once (inline, with the first figure), so it opens offline.
Does not own: any analysis or plotting of its own, nor the trace file (`Session.export_trace`).
"""
from __future__ import annotations

import dataclasses
import datetime
import html
import os
from pathlib import Path

import pandas as pd
import plotly.io as pio

from .dashboard import format_bytes, headline
from .trace import summarize

LAST_STEPS = 10  # rows of the summary table
_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 32px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; }
.note { color: #666; font-size: 13px; }
table.stalls td, table.steps td { white-space: nowrap; }
table.stalls td:nth-child(7) { text-align: left; white-space: normal; }
"""


def write_report(session, path: str | os.PathLike) -> Path:
    """Write one self-contained HTML page about `session` (open it in any browser, offline).

    Sections: headline numbers; a summary table of the last steps; run history; the last step's
    timeline with its stalls, weight/grad buffers and memory; the stalls table and where the step's
    time went (`trace.summarize`); the host memory report (bytes by category, bytes/param); every
    optimizer and engine setting. Sections that need a step or a trace say so when there is none.

    Args:
        session: a `Session` (after some steps, for anything but settings and memory).
        path: the .html file to write; parent directories are created.
    Returns:
        The path written, as a Path.
    Example:
        >>> write_report(s, "out/run1.html")        # doctest: +SKIP
        PosixPath('out/run1.html')
    """
    path = Path(path)
    figs, plotly_js = [], [True]  # plotly.js goes inline with the first figure only

    def figure(fig, div_id: str) -> str:
        out = pio.to_html(fig, include_plotlyjs=plotly_js[0], full_html=False, div_id=div_id,
                          config={"displaylogo": False})
        plotly_js[0] = False
        figs.append(div_id)
        return out

    parts = [f"<h1>megatrain_nb run report</h1><p>{html.escape(repr(session))}<br>"
             f"<span class='note'>written {datetime.datetime.now().isoformat(timespec='seconds')}</span></p>"]
    parts.append("<h2>Headline</h2>" + _headline_table(headline(session)))
    hist = session.history_dataframe()
    parts.append("<h2>Last steps</h2>")
    if len(hist):
        parts.append(_table(hist.tail(LAST_STEPS), "steps"))
        parts.append("<h2>Run history</h2>" + figure(session.plot_history(), "fig-history"))
    else:
        parts.append("<p class='note'>No steps yet: run s.step(...) or s.train(...) first.</p>")
    tr = session.trace
    parts.append("<h2>Last step</h2>")
    if tr is not None and len(tr.spans):
        spans = tr.to_dataframe()
        parts.append(figure(session.plot_timeline(), "fig-timeline"))
        if len(tr.slots):
            parts.append("<h3>Device buffers</h3>" + figure(session.plot_buffers(), "fig-buffers"))
        if len(tr.counters):
            parts.append("<h3>Memory</h3>" + figure(session.plot_memory(), "fig-memory"))
        stalls = session.stalls()
        parts.append(f"<h3>Stalls ({len(stalls)}, {stalls.dur_ms.sum():.3g} ms)</h3>")
        parts.append(_table(stalls, "stalls") if len(stalls)
                     else "<p class='note'>Compute never waited 0.05 ms or more.</p>")
        parts.append("<h3>Where the step's time went</h3>" + _summary_table(summarize(spans)))
    else:
        note = "no step yet" if not len(hist) else "tracing is off (trace=False)"
        parts.append(f"<p class='note'>No trace of the last step: {note}.</p>")
    parts.append("<h2>Host memory (bytes/param)</h2>" + _memory_table(session.memory_report()))
    parts.append("<h2>Settings</h2>" + _settings_table(session))
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>megatrain_nb report</title>"
            f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def _table(df: pd.DataFrame, cls: str) -> str:
    """A DataFrame as an HTML table with class `cls`; floats to 4 significant digits."""
    return df.to_html(classes=cls, index=False, border=0, float_format=lambda v: f"{v:.4g}", escape=True)


def _rows(rows: list[tuple[str, str]], cls: str) -> str:
    """A two-column HTML table of (name, value) rows, both escaped."""
    body = "".join(f"<tr><th class='text'>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table class='{cls}'>{body}</table>"


def _headline_table(h: dict) -> str:
    fmt = lambda v, spec: "–" if v is None else f"{v:{spec}}"  # noqa: E731
    return _rows([("step", fmt(h["step"], "d")), ("loss", fmt(h["loss"], ".4f")),
                  ("tokens/s", fmt(h["tokens_per_s"], ",.0f")), ("model TFLOPS", fmt(h["tflops"], ".3g")),
                  ("peak device memory (last step)", format_bytes(h["peak_device_bytes"])),
                  ("peak host RSS (last step)", format_bytes(h["peak_host_rss_bytes"])),
                  ("host store", f"{format_bytes(h['host_store_bytes'])}, {h['bytes_per_param']:.2f} bytes/param")],
                 "headline")


def _summary_table(sm: dict) -> str:
    rows = [("step (ms)", f"{sm['step_ms']:.4g}"), ("compute busy (ms)", f"{sm['compute_busy_ms']:.4g}"),
            ("compute busy share", f"{sm['compute_busy_share']:.1%}"), ("stalled (ms)", f"{sm['stall_ms']:.4g}")]
    rows += [(f"waited on {k} (ms)", f"{v:.4g}") for k, v in sm["wait_ms_by_cause"].items()]
    rows += [(f"{lane} bytes", f"{sm[f'bytes_{lane}']:,}") for lane in ("h2d", "d2h")]
    rows += [(f"{lane} GB/s", f"{sm[f'{lane}_GBps']:.3g}") for lane in ("h2d", "d2h")]
    return _rows(rows, "time")


def _memory_table(rep: dict) -> str:
    n = rep["params"]
    rows = [(k, v if isinstance(v, str) else f"{format_bytes(v)} ({v / n:.2f} bytes/param)") for k, v in rep.items()
            if k not in ("total", "params", "bytes_per_param")]  # a str: words (``gradients``)
    rows += [("total", f"{format_bytes(rep['total'])} ({rep['bytes_per_param']:.2f} bytes/param)"),
             ("parameters", f"{n:,}")]
    return _rows(rows, "memory")


def _settings_table(session) -> str:
    rows = []
    for cfg in (session.optim_cfg, session.engine_cfg):
        rows += [(f"{type(cfg).__name__}.{f.name}", str(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)]
    return _rows(rows, "settings")
