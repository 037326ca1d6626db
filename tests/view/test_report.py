"""Tests for megatrain_nb.view.report.write_report: one standalone page with every figure and table."""
from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd
import pytest

from conftest import make_config
from megatrain_nb import Session
from megatrain_nb.data import synthetic_batches
from megatrain_nb.view.report import write_report


def trained(n: int, **settings) -> Session:
    s = Session.from_config(make_config("llama"), device="cpu", lr=1e-2, seed=0, **settings)
    it = synthetic_batches(96, batch=2, seq=16, kind="successor", alphabet=96)
    for _ in range(n):
        s.step(next(it))
    return s


@dataclass
class Page:
    html: str
    history: list
    stalls: pd.DataFrame
    memory: dict
    session_repr: str


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Page:
    s = trained(3)
    try:
        path = write_report(s, tmp_path_factory.mktemp("r") / "sub" / "run.html")  # parent created
        assert path.name == "run.html" and path.is_file()
        return Page(path.read_text(encoding="utf-8"), list(s.history), s.stalls(), s.memory_report(), repr(s))
    finally:
        s.close()


def test_every_figure_div_is_there_and_plotly_js_is_inlined_once(page):
    html = page.html
    assert re.findall(r'<div id="(fig-[a-z]+)"', html) == ["fig-history", "fig-timeline", "fig-buffers", "fig-memory"]
    assert html.count("Plotly.newPlot(") == 4
    assert html.count("plotly.js v") == 1  # the library's banner: inlined with the first figure only
    assert not re.search(r"<script[^>]*\bsrc=", html)  # nothing fetched: opens offline
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")


def test_stalls_table_lists_every_stall(page):
    stalls = page.stalls
    m = re.search(r'<table[^>]*class="dataframe stalls"[^>]*>(.*?)</table>', page.html, re.S)
    assert m, "no stalls table"
    body = m.group(1)
    assert all(f"<th>{c}</th>" in body for c in ("start_ms", "dur_ms", "waited_on", "diagnosis", "setting"))
    assert body.count("<tr") == len(stalls) + 1  # header row + one per stall
    assert f"Stalls ({len(stalls)}," in page.html


def test_memory_report_settings_and_last_steps(page):
    html, history, rep = page.html, page.history, page.memory
    assert "bytes/param" in html
    assert f"{rep['bytes_per_param']:.2f} bytes/param" in html
    assert f"{rep['params']:,}" in html
    assert "OptimConfig.lr</th><td>0.01" in html and "EngineConfig.device</th><td>cpu" in html
    m = re.search(r'<table[^>]*class="dataframe steps"[^>]*>(.*?)</table>', html, re.S)
    assert m and m.group(1).count("<tr") == len(history) + 1
    assert f"{history[-1].loss:.4g}" in m.group(1)
    assert "Where the step" in html and "compute busy share" in html
    assert page.session_repr in html


def test_report_without_steps_or_trace_says_so(tmp_path):
    s = Session.from_config(make_config("llama"), device="cpu", lr=1e-2)
    try:
        html = write_report(s, tmp_path / "empty.html").read_text()
    finally:
        s.close()
    assert "No steps yet" in html and "No trace of the last step: no step yet" in html
    assert "fig-" not in html and "bytes/param" in html

    s = trained(2, trace=False)
    try:
        html = write_report(s, tmp_path / "notrace.html").read_text()
    finally:
        s.close()
    assert re.findall(r'<div id="(fig-[a-z]+)"', html) == ["fig-history"]
    assert html.count("plotly.js v") == 1  # the first (and only) figure carries the library
    assert "tracing is off (trace=False)" in html
