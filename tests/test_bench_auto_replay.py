"""bench/auto_replay.py on CPU: the H100's recorded measuring-step inputs, replayed through today's search."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import auto_replay  # noqa: E402

ROWS = ROOT / "bench" / "results" / "h100-2026-12-06-defaults.jsonl"


def _recorded(row: dict) -> dict:
    """The planner's seconds per candidate as the row's summary printed them."""
    names = {v: k for k, v in auto_replay.placing.Search.NAMES.items()}
    return {names[n]: float(s) for n, s in re.findall(r"(activations first|the forward's head resident|residency first) "
                                                         r"([0-9.]+) s", row["placement_search"])}


def test_replay_reproduces_each_rows_prediction_for_a_and_c_is_no_worse_than_the_cover():
    rows = [json.loads(line) for line in ROWS.read_text().splitlines()]
    replayed = 0
    for row in rows:
        search = auto_replay.replay(row)
        if search is None:
            continue
        replayed += 1
        then = _recorded(row)
        # the row's settings are not all recorded (x 1 replays 0.261 s for 0.263): within 1%, or shorter by what
        # the planner now models and the rows' planner did not: the next forward's early rows and the embedding's
        # gradient as touched rows (Note: [Early rows]), which only shorten A's wait (6% at most on these rows)
        assert then["A"] * 0.93 <= search.predicted["A"] <= then["A"] * 1.01, row["placement_search"]
        if "C" in then:  # the cover of A's wait is C's largest budget: the best of them is no slower
            assert search.predicted["C"] <= then["C"] + 5e-4
            assert search.residents["C"] <= search.residents["B"]
    assert replayed == sum(bool(r.get("placement_inputs")) for r in rows) >= 18  # every row that recorded its inputs


def test_the_command_prints_each_row_then_and_now(capsys):
    auto_replay.main([str(ROWS), "--margin", "0.05"])
    out = capsys.readouterr().out
    n = sum(bool(json.loads(line).get("placement_inputs")) for line in ROWS.read_text().splitlines())
    assert n >= 18 and out.count("  then: auto chose") == n and out.count("  now:  auto chose") == n
    assert "within 5%" in out.split("now:", 1)[1]  # the margin given reaches the search


def test_a_card_it_does_not_know_is_named():
    with pytest.raises(ValueError, match="NVIDIA L4.*add its memory to CARD_BYTES"):
        auto_replay.card_bytes({"gpu": "NVIDIA L4"})
    assert auto_replay.card_bytes({"gpu": "NVIDIA H200", "device_memory": "24GiB"}) == 24 << 30
