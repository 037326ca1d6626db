"""Helpers shared by tests in tests/view/ only (what other folders share is in tests/helpers.py)."""
from __future__ import annotations


def check_chrome(events: list[dict], lanes: set[str]) -> None:
    """Chrome Trace Event schema as Perfetto reads it."""
    for e in events:
        if e["ph"] == "X":
            assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0
            assert {"layer", "phase", "bytes"} <= set(e["args"]) or e["cat"] == "slot"
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes <= names
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert set(starts) == set(ends)
    assert all(ends[i]["ts"] >= starts[i]["ts"] for i in starts)
