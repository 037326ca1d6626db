"""bench/posttrain.py on CPU: one row per mode and a summary whose ratios are finite.

The tiny shape on device "cpu": the timings mean nothing and nothing asserts on their values; what is
checked is that every mode ran and left its row (each appended as it came), that both generators made
exactly --gen-new tokens a row (the tool raises otherwise), and that the summary carries every ratio, its
target and the host-memory bound.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import posttrain  # noqa: E402
from shapes import count_params, qwen_config  # noqa: E402

TINY = ["--device", "cpu", "--shape", "tiny", "--batch", "4", "--seq", "64", "--prompt", "16", "--group", "4",
        "--steps", "1", "--warmup", "1", "--gen-prompts", "4", "--gen-prompt-len", "8", "--gen-new", "8"]


def test_every_mode_leaves_a_row_and_the_summary_its_ratios(tmp_path):
    out = tmp_path / "post.jsonl"
    rows = posttrain.main([*TINY, "--out", str(out)])
    assert [json.loads(ln) for ln in out.read_text().splitlines()] == rows
    by_mode = {r["mode"]: r for r in rows}
    assert [r["mode"] for r in rows] == [*posttrain.MODES, "summary"]
    for r in rows:
        assert (r["bench"], r["shape"], r["seq"], r["batch"], r["device"]) == ("posttrain", "tiny", 64, 4, "cpu")
    for mode in posttrain.MODES:
        assert by_mode[mode]["tokens_per_s"] > 0, mode
    for mode in ("generate", "hf_generate"):
        assert (by_mode[mode]["prompts"], by_mode[mode]["new_tokens"]) == (4, 8)
    ref = by_mode["reference"]
    assert ref["snapshot_bytes"] > 0 and ref["meminfo_gib_before"]["MemAvailable"] > 0
    s = by_mode["summary"]
    assert set(s["targets"]) == set(posttrain.TARGETS) == set(s["meets"])
    for name in posttrain.TARGETS:
        assert math.isfinite(s[name]) and s[name] > 0, name
    assert s["hook_vs_ce"] == pytest.approx(by_mode["hook"]["step_s"] / by_mode["ce"]["step_s"], rel=0.02)
    params = count_params(qwen_config("tiny"))
    assert by_mode["ce"]["params"] == params
    assert s["rss_bound_gib"] == pytest.approx((14.2 * params + 4 * 2**30) / 2**30, abs=0.01)
    assert s["peak_rss_gib"] > 0 and isinstance(s["rss_within_bound"], bool)


def test_skipped_modes_leave_no_row_and_no_ratio(tmp_path):
    rows = posttrain.main([*TINY, "--skip", "hf_generate", "reference", "generate"])
    assert [r["mode"] for r in rows] == ["ce", "hook", "logprobs", "summary"]
    s = rows[-1]
    assert s["generate_vs_hf"] is None and s["reference_vs_train"] is None and s["meets"]["generate_vs_hf"] is None
    assert s["hook_vs_ce"] > 0 and s["skipped"] == ["hf_generate", "reference", "generate"]


def test_an_eos_that_stops_generation_is_refused():
    import torch

    with pytest.raises(RuntimeError, match="generated 3 tokens a row, not --gen-new 8"):
        posttrain.check_new(torch.zeros(2, 3, dtype=torch.long), 8, "generate")


def test_groups_must_be_whole():
    with pytest.raises(SystemExit):
        posttrain.main([*TINY, "--batch", "6"])  # --group 4
