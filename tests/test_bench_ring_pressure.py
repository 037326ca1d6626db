"""bench/ring_pressure.py --trace on CPU: a step saved on a GPU, drawn here with the ring's waits summed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import ring_pressure  # noqa: E402

from megatrain_nb.view.trace import Trace  # noqa: E402

SAVED = ROOT / "bench" / "traces" / "auto" / "h100-2026-12-06-3b-b4-ring.json.gz"


def test_a_saved_step_is_drawn_with_its_ring_waits_summed(tmp_path):
    spans = Trace.load(SAVED).to_dataframe()
    ring = spans[spans.op == "wait-ring"]
    assert len(ring) == 17 and (ring.lane == "host-unpack").all()  # the H100's 3B x 4 step: its own figures
    ring_pressure.main(["--trace", str(SAVED), "--out", str(tmp_path / "ring")])
    page = (tmp_path / "ring.html").read_text()
    assert f"waited {ring.dur_ms.sum():.0f} ms for ring buffers (17 times)" in page
    assert "wait-ring" in page and "plotly" in page


def test_a_bad_trace_is_named(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="x.json"):
        ring_pressure.main(["--trace", str(bad), "--out", str(tmp_path / "ring")])
    with pytest.raises(SystemExit):  # argparse: --trace needs --out
        ring_pressure.main(["--trace", str(SAVED)])
