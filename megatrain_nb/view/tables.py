"""What a table looks like in Jupyter: the package's tables keep their types for code (a DataFrame stays a
DataFrame, a dict a dict) and render as rounded, formatted HTML in a notebook.

Owns: `Table` (a DataFrame whose HTML rounds floats to 4 significant digits; what `trace.find_stalls`
returns), `Summary` (the dict of `trace.summarize`, shown as a two-column table with units) and
`MemoryReport` (the dict of `Session.memory_report`, shown as bytes in MiB / GiB and bytes per parameter).
Does not compute anything: each wraps a value built elsewhere.
"""
from __future__ import annotations

import html

import pandas as pd

from .palette import MEMORY_LABELS, label

_GIB, _MIB = float(1 << 30), float(1 << 20)


def _bytes(b: float) -> str:
    """'1.23 GiB' from 1 GiB up, else '12.3 MiB'."""
    return f"{b / _GIB:,.2f} GiB" if abs(b) >= _GIB else f"{b / _MIB:,.1f} MiB"


def _rows(rows: list[tuple[str, str]], head: tuple[str, str]) -> str:
    """A two-column HTML table, escaped."""
    body = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:right'>"
                   f"{html.escape(v)}</td></tr>" for k, v in rows)
    return (f"<table><thead><tr><th style='text-align:left'>{html.escape(head[0])}</th>"
            f"<th style='text-align:right'>{html.escape(head[1])}</th></tr></thead><tbody>{body}</tbody></table>")


class Table(pd.DataFrame):
    """A DataFrame that shows its floats rounded (4 significant digits) in a notebook; for code it is a
    DataFrame (a selection of it is a `Table` too).

    Example:
        >>> t = Table({"dur_ms": [0.123456]}); isinstance(t, pd.DataFrame), "0.1235" in t._repr_html_()
        (True, True)
    """

    @property
    def _constructor(self):
        return Table

    def _repr_html_(self) -> str:
        return self.to_html(float_format=lambda v: f"{v:.4g}", max_rows=60, border=0)


class Summary(dict):
    """`trace.summarize`'s dict, shown as a table with units in a notebook.

    Example:
        >>> "step (ms)" in Summary(step_ms=2.0, wait_ms_by_cause={"h2d": 1.0})._repr_html_()
        True
    """

    _WORDS = {"step_ms": "step (ms)", "compute_busy_ms": "compute busy (ms)", "compute_busy_share": "compute busy share",
              "stall_ms": "stalled (ms)", "bytes_h2d": "h2d bytes", "bytes_d2h": "d2h bytes",
              "h2d_GBps": "h2d GB/s", "d2h_GBps": "d2h GB/s"}

    def _repr_html_(self) -> str:
        rows = []
        for k, v in self.items():
            if isinstance(v, dict):
                rows += [(f"waited on {c} (ms)", f"{x:.4g}") for c, x in v.items()]
            elif k.endswith("share"):
                rows.append((self._WORDS.get(k, k), f"{v:.1%}"))
            elif k.startswith("bytes_"):
                rows.append((self._WORDS.get(k, k), f"{v:,}"))
            else:
                rows.append((self._WORDS.get(k, k), f"{v:.4g}" if isinstance(v, float) else str(v)))
        return _rows(rows, ("one step", "value"))


class MemoryReport(dict):
    """`Session.memory_report`'s dict, shown in a notebook as bytes by category (MiB / GiB) with bytes per
    parameter; for code it is the dict of bytes.

    Example:
        >>> "2.0 MiB" in MemoryReport(master=2 << 20, total=2 << 20, params=1 << 19, bytes_per_param=4.0)._repr_html_()
        True
    """

    def _repr_html_(self) -> str:
        n = self.get("params") or 0
        rows = []
        for k, v in self.items():
            if k in ("params", "bytes_per_param", "total"):
                continue
            if k == "fp32_moment_params":
                rows.append(("parameters with fp32 AdamW moments", f"{int(v):,}"))
            elif isinstance(v, str):  # words: where the gradients wait, and why (Note: [Gradient ring])
                rows.append((k, v))
            else:
                rows.append((f"{label(k, MEMORY_LABELS)} ({k})", _bytes(v) + (f" · {v / n:.2f} B/param" if n else "")))
        if "total" in self:
            rows.append(("host store total", _bytes(self["total"]) + f" · {self.get('bytes_per_param', 0):.2f} B/param"))
        if n:
            rows.append(("parameters", f"{int(n):,}"))
        return _rows(rows, ("memory", "bytes"))
