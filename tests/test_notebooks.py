"""The notebooks as files: committed without outputs, GPU cells tagged and guarded, and no number in their
prose that no cell prints or asserts (the rule: `test_every_number_in_prose_is_printed_or_asserted`).

Running them is `python -m pytest --nbmake notebooks/` (each runs top to bottom on CPU).
"""
from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
GUARD = "if torch.cuda.is_available():"


def test_the_five_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["00_quickstart.ipynb", "01_memory_hierarchy.ipynb",
                                           "02_overlap_stalls.ipynb", "03_finetune_local_model.ipynb",
                                           "04_post_training.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_valid_and_without_outputs(path):
    ids = [c.get("id") for c in json.loads(path.read_text())["cells"]]  # as saved: nbformat.read fills in what lacks one
    assert None not in ids and len(set(ids)) == len(ids), f"cells without an id or with a repeated one: {ids}"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"cell {i} has outputs: clear them"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_gpu_cells_are_tagged_and_guarded(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        gpu = "gpu" in cell.metadata.get("tags", [])
        uses_cuda = 'device="cuda"' in cell.source or "device='cuda'" in cell.source
        if uses_cuda:
            assert gpu, f"cell {i} uses CUDA: tag it 'gpu'"
        if gpu:
            assert cell.source.lstrip().startswith(GUARD), f"gpu cell {i} must start with {GUARD!r}"


NAMES = {"3B", "7B", "14B", "32B"}  # the model shapes the notebooks name (bench/shapes.py)
_STRIP = [re.compile(p, re.M) for p in (
    r"`[^`]*`",                        # code spans
    r"\]\([^)]*\)",                     # link targets
    r"^#+\s*\d+\s*·",                   # a heading's number
    r"^\s*\d+\.\s",                      # a numbered list's markers
    r"\b\d{4}-\d{2}-\d{2}\b",           # dates
    r"\b\d+K\b",                        # context lengths (4K .. 512K tokens)
    r"\b(?:%s)\b" % "|".join(NAMES),    # model-shape labels
)]
# a number not glued to a word on its left; an optional suffix (K, M, B, G, x, ×, %) on its right
_NUMBER = re.compile(r"(?<![\w.\-−])(\d+(?:,\d{3})*(?:\.\d+)?)([%×xKMBG]?)(?![\w.]*\d)(?![A-Za-z_])")


def _literals(source: str) -> tuple[set, set]:
    """(literals inside asserts, literals passed as keyword arguments or assigned to a name)."""
    tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))

    def nums(node):
        return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
                and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)}

    asserted = set().union(*[nums(n) for n in ast.walk(tree) if isinstance(n, ast.Assert)])
    settings = set().union(*[nums(n.value) for n in ast.walk(tree) if isinstance(n, ast.keyword)],
                           *[nums(n.value) for n in ast.walk(tree)  # NAME = 480 or A, B = 480, 6
                             if isinstance(n, ast.Assign) and isinstance(n.value, (ast.Constant, ast.Tuple))])
    return asserted, settings


def _covered(value: float, suffix: str, pool: set) -> bool:
    targets = [value] + ([value / 100] if suffix == "%" else [])
    return any(math.isclose(t, v, rel_tol=1e-9, abs_tol=1e-12) for t in targets for v in pool)


def prose_numbers(path: Path) -> list[str]:
    """Each number in the notebook's markdown that no code cell asserts or sets, as 'cell i: text'."""
    nb = nbformat.read(path, as_version=4)
    asserted, settings = set(), set()
    for cell in nb.cells:
        if cell.cell_type == "code":
            a, k = _literals(cell.source)
            asserted |= a
            settings |= k
    bad = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        text = cell.source
        for pattern in _STRIP:
            text = pattern.sub(" ", text)
        for m in _NUMBER.finditer(text):
            value = float(m.group(1).replace(",", ""))
            if _covered(value, m.group(2), asserted) or _covered(value, "", settings):
                continue
            line = text[max(0, m.start() - 30):m.end() + 20].replace("\n", " ")
            bad.append(f"cell {i}: {m.group(0)!r} in '...{line}...'")
    return bad


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_number_in_prose_is_printed_or_asserted(path):
    """Numbers in prose: a markdown cell states no number that no cell computes.

    Prose that quotes a number goes stale the day the code, the planner's rates or a recorded trace
    changes, and nothing says so. The rule, per markdown cell:

    - A quantity (a time, a share, a byte count, a rate, a layer index read from a trace) is not written
      in markdown. A code cell prints it (an f-string ``print``, or ``IPython.display.Markdown(f"...")``
      rendered from computed values), or the markdown states it and a code cell of the same notebook
      asserts it: the same literal, in the same unit, inside an ``assert`` statement
      (``assert abs(step_s - 1.71) < 0.01`` covers "1.71 s"; "13%" is covered by 13 or 0.13).
    - A setting the code chooses may be named: a numeric literal passed as a keyword argument
      (``steps=150`` covers "150 steps") or assigned to a name (``PAPER_HOST_GB = 480`` covers "480 GB").
    - Names are not numbers: digits glued to a word (H200, fp32, bf16, int8, Qwen2.5, b1), the
      model-shape labels in NAMES ("3B", "7B", ...), context lengths written as "128K", dates, a
      heading's own number ("## 2 · ...") and a numbered list's markers, and everything in code spans
      or link targets.

    So a stated number is either computed where the reader sees it, or checked when the notebook runs
    (``pytest --nbmake``), which then fails if the number and its source disagree.
    """
    bad = prose_numbers(path)
    assert not bad, (f"{path.name}: numbers in markdown that no cell computes (print them from a cell, or "
                     "assert them in one; the rule is this test's docstring):\n  " + "\n  ".join(bad))


def test_the_number_rule_catches_a_stale_number(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# 09 · Title\n\n1. A `seq=4096` step of the 3B model at 128K takes 1.71 s "
                                      "(13% shorter), 150 steps, at 480 GB, on an H200 in fp32, 2026-12-01."),
        nbformat.v4.new_code_cell("HOST_GB = 480\nx = run(steps=150)\nassert abs(x - 1.71) < 0.01\n"
                                  "assert abs(y - 0.13) < 0.01"),
    ])
    nbformat.write(nb, tmp_path / "ok.ipynb")
    assert prose_numbers(tmp_path / "ok.ipynb") == []
    nb.cells[0].source += " Compute is busy 24% of it, for 0.15 s."
    nb.cells[1].source += "\nassert busy_ms == 150  # the same quantity in another unit covers nothing"
    nbformat.write(nb, tmp_path / "stale.ipynb")
    assert [b.split(" in ")[0] for b in prose_numbers(tmp_path / "stale.ipynb")] == ["cell 0: '24%'", "cell 0: '0.15'"]
