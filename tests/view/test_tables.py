"""Tests for megatrain_nb.view.tables: the package's tables keep their types for code and show formatted,
rounded HTML in a notebook."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import make_config
from megatrain_nb import Session
from megatrain_nb.data import synthetic_batches
from megatrain_nb.view.tables import MemoryReport, Summary, Table
from megatrain_nb.view.trace import Trace, find_stalls, summarize


@pytest.fixture(scope="module")
def session():
    s = Session.from_config(make_config("llama"), device="cpu", lr=1e-2, seed=0)
    it = synthetic_batches(96, batch=2, seq=16, kind="successor", alphabet=96)
    for _ in range(2):
        s.step(next(it))
    yield s
    s.close()


def test_memory_report_is_a_dict_of_bytes_shown_in_mib(session):
    rep = session.memory_report()
    assert isinstance(rep, dict) and isinstance(rep, MemoryReport)
    assert rep["total"] == sum(rep[k] for k in ("master", "grad", "exp_avg", "exp_avg_sq", "shadow", "grad_ring",
                                                "grad_rows"))
    json.dumps(rep)  # still plain data
    page = rep._repr_html_()
    assert f"{rep['master'] / 2**20:,.1f} MiB" in page and "fp32 master weights (master)" in page
    assert f"{rep['bytes_per_param']:.2f} B/param" in page and f"{rep['params']:,}" in page


def test_stalls_are_a_dataframe_rounded_in_a_notebook(session):
    st = session.stalls()
    assert isinstance(st, pd.DataFrame) and isinstance(st, Table)
    assert isinstance(st[["dur_ms"]].head(3), Table)  # a selection keeps the notebook view
    t = Table({"dur_ms": [0.123456789], "waited_on": ["h2d"]})
    assert "0.1235" in t._repr_html_() and "0.123456789" not in t._repr_html_()
    spans = Trace(step=0, spans=[("compute", "fwd", 0, "fwd", 0.0, 2.0, 0), ("h2d", "h2d", 1, "io", 1.0, 3.0, 0),
                                 ("compute", "fwd", 1, "fwd", 3.0, 5.0, 0)]).to_dataframe()
    assert find_stalls(spans).dur_ms.tolist() == [1.0]


def test_summary_is_a_dict_shown_with_units(session):
    sm = summarize(session.trace.to_dataframe())
    assert isinstance(sm, dict) and isinstance(sm, Summary) and set(sm) >= {"step_ms", "wait_ms_by_cause"}
    page = sm._repr_html_()
    assert f"{sm['step_ms']:.4g}" in page and "step (ms)" in page and f"{sm['compute_busy_share']:.1%}" in page
    assert all(f"waited on {c} (ms)" in page for c in sm["wait_ms_by_cause"])
