"""bench/throughput.py on CPU, as the suites run it (a process of its own): the gpt-oss shape on the stdlib's text
and the dense tiny shape on random ids each leave one row naming its shape and its data.

The timings on device "cpu" mean nothing and nothing asserts on them; what is checked is what a reader of the
row relies on: the shape and data it names, an MoE's active parameters under its total (the planner's count of
the same shape), and for stdlib data every step's loss.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from shapes import GPT_OSS_TINY  # noqa: E402

SMALL = ["--batch", "2", "--seq", "64", "--steps", "2", "--warmup", "1", "--device", "cpu"]


def _run(tmp_path, *args) -> subprocess.CompletedProcess:
    """``python bench/throughput.py ARGS --out tmp_path/rows.jsonl`` from the repository root (~5 s)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), *args,
                           "--out", str(tmp_path / "rows.jsonl")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)


def _row(tmp_path, *args) -> dict:
    r = _run(tmp_path, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 1, rows  # one batch size: one row
    return rows[0]


def test_gpt_oss_tiny_on_the_stdlib_text(tmp_path):
    from megatrain_nb.machine.shape import model_shape

    row = _row(tmp_path, "--shape", "gpt-oss-tiny", "--data", "stdlib", *SMALL)
    assert (row["shape"], row["data"], row["layers"], row["batch"], row["seq"]) == ("gpt-oss-tiny", "stdlib", 2, 2, 64)
    want = model_shape(GPT_OSS_TINY)
    assert (row["params"], row["active_params"]) == (want["n_params"], want["active_params"])
    assert row["active_params"] < row["params"]  # an MoE: 2 of 4 experts a token
    assert row["data_vocab"] == 512  # the BPE clamped under the model's vocabulary
    steps = row["loss_steps"]
    assert len(steps) == len(row["steps_s"]) >= 3  # every step: the warm-up one and the two timed
    assert all(math.isfinite(x) and x > 0 for x in steps)
    assert (steps[0], steps[-1]) == (row["loss_first"], row["loss_last"])
    assert row["loss_first"] == pytest.approx(math.log(512), abs=0.3)  # a fresh model guesses near uniformly


def test_tiny_on_random_ids(tmp_path):
    row = _row(tmp_path, "--shape", "tiny", "--data", "random", *SMALL)
    assert (row["shape"], row["data"]) == ("tiny", "random")
    assert row["active_params"] == row["params"]  # dense
    assert math.isfinite(row["loss_first"]) and "loss_steps" not in row


def test_too_little_text_for_the_batch_names_the_fix(tmp_path):
    r = _run(tmp_path, "--shape", "tiny", "--data", "stdlib", "--device", "cpu", "--batch", "2", "--seq", "400000")
    assert r.returncode == 2
    assert "fewer than --batch 2; give a smaller --seq" in r.stderr, r.stderr[-2000:]
