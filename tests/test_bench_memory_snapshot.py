"""bench/memory_snapshot.py on CPU: the summaries a person reads from torch's allocator snapshot.

Snapshots are built by hand in torch's format (``segments`` with ``blocks``; ``device_traces`` of alloc and
free events): the tool's arithmetic is checked, not the allocator. On the GPU the same code ran inside
``bench/throughput.py --oom-snapshot`` (docs/benchmarks.md, Budgets).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import memory_snapshot as ms  # noqa: E402

GIB = 1 << 30


def _frames(path: str, line: int, name: str) -> list[dict]:
    """A stack as torch records it, innermost first: torch's own frame, then ours, then the caller's."""
    return [{"filename": "/venv/torch/nn/functional.py", "line": 2000, "name": "linear"},
            {"filename": f"/repo/megatrain_nb/{path}", "line": line, "name": name},
            {"filename": "/repo/bench/throughput.py", "line": 9, "name": "main"}]


def test_the_site_is_our_innermost_frame_else_the_innermost_python_one():
    assert ms.site(_frames("step/tiling.py", 62, "forward")) == "megatrain_nb/step/tiling.py:62 forward"
    assert ms.site([{"filename": "/venv/torch/nn/functional.py", "line": 3, "name": "linear"}]) \
        == "nn/functional.py:3 linear"
    assert ms.site([]) == "?:0 ?"


def test_live_blocks_are_summed_by_site_largest_first_and_free_ones_are_only_reserved():
    snap = {"segments": [
        {"total_size": 4 * GIB, "blocks": [
            {"size": GIB, "state": "active_allocated", "frames": _frames("model/binding.py", 116, "call")},
            {"size": GIB, "state": "active_allocated", "frames": _frames("model/binding.py", 116, "call")},
            {"size": GIB // 2, "state": "active_allocated", "frames": _frames("step/engine.py", 86, "<lambda>")},
            {"size": 3 * GIB // 2, "state": "inactive", "frames": _frames("step/tiling.py", 62, "forward")}]},
        {"total_size": GIB, "blocks": [
            {"size": GIB, "state": "active_allocated", "frames": _frames("step/engine.py", 86, "<lambda>")}]}]}
    lines = ms.summarize(snap).splitlines()
    assert lines[0] == ("allocated 3.50 GiB in 4 blocks; reserved 5.00 GiB in 2 segments "
                        "(1.50 GiB cached, not in use)")
    assert lines[2].split() == ["2.000", "2", "megatrain_nb/model/binding.py:116", "call"]
    assert lines[3].split() == ["1.500", "2", "megatrain_nb/step/engine.py:86", "<lambda>"]
    assert not any("tiling" in ln for ln in lines)  # a freed block is reserved, not held by its site


def test_the_peak_is_the_most_live_at_once_and_says_what_held_it():
    a, b, c = (_frames("model/binding.py", 116, "call"), _frames("step/tiling.py", 86, "backward"),
               _frames("step/head.py", 68, "loss"))
    ev = [dict(action="alloc", addr=1, size=4, frames=a),
          dict(action="alloc", addr=2, size=3, frames=b),
          dict(action="free_requested", addr=2, size=3, frames=b),  # still held until its stream is done
          dict(action="alloc", addr=3, size=2, frames=c),  # 4 + 3 + 2 = 9: the peak
          dict(action="free_completed", addr=2, size=3, frames=b),
          dict(action="alloc", addr=4, size=4, frames=c),  # 4 + 2 + 4 = 10: a later, higher peak
          dict(action="free_completed", addr=4, size=4, frames=c),
          dict(action="free_completed", addr=99, size=50, frames=a)]  # made before the history: ignored
    best, by = ms.peak({"device_traces": [ev]})
    assert best == 10
    assert dict(by) == {ms.site(a): 4, ms.site(c): 6}
    assert ms.peak({"device_traces": [ev[:4]]}) == (9, {ms.site(a): 4, ms.site(b): 3, ms.site(c): 2})

