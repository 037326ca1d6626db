"""Every tool in bench/ answers ``--help`` (its usage), and every other file there is a module the tools import."""
from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"
FILES = sorted(BENCH.glob("*.py"))


def _is_tool(path: pathlib.Path) -> bool:
    """Whether the file runs as a script (an ``if __name__ == "__main__":`` block)."""
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in ast.parse(path.read_text()).body)


TOOLS = [p for p in FILES if _is_tool(p)]
HELPERS = [p for p in FILES if not _is_tool(p)]


def test_bench_holds_tools():
    assert len(TOOLS) >= 10, [p.name for p in FILES]


def _help(path: pathlib.Path) -> subprocess.CompletedProcess:
    """``python bench/<tool> --help`` from the repository root."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(path), "--help"], cwd=BENCH.parent, env=env, capture_output=True,
                          text=True, timeout=100)


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: p.name)
def test_tool_answers_help(path):
    r = _help(path)  # one at a time: each well inside conftest's 120 s watchdog
    missing = re.search(r"ModuleNotFoundError: No module named '([^']+)'", r.stderr)
    if r.returncode and missing and not missing.group(1).startswith(("megatrain_nb", "bench")):
        pytest.skip(f"{path.name} needs {missing.group(1)}, not installed here")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.lstrip().startswith("usage:"), r.stdout[:500]


@pytest.mark.parametrize("path", HELPERS, ids=lambda p: p.name)
def test_a_file_without_main_is_a_module_of_the_tools(path):
    """Not a forgotten tool: another bench file imports it."""
    users = [p.name for p in FILES if p != path and re.search(rf"^\s*(from|import) {path.stem}\b", p.read_text(), re.M)]
    assert users, f"bench/{path.name} has no __main__ and no bench tool imports it"


def test_the_moe_plan_in_the_docs_is_what_the_tool_prints_now():
    """docs/benchmarks.md's gpt-oss-20b table is a prediction of this code's planner: a change to the planner
    that moves it fails here until the table is printed again (``bench/moe_plan.py``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH.parent), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(BENCH / "moe_plan.py")], cwd=BENCH.parent, env=env, capture_output=True,
                       text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    printed = [line for line in r.stdout.splitlines() if line.startswith("| H200 |")]
    docs = (BENCH.parent / "docs" / "benchmarks.md").read_text()
    shown = [line for line in docs.splitlines() if line.startswith("| H200 |")]
    assert len(printed) == 9 and printed == shown, "\n".join(["printed:", *printed, "docs:", *shown])
