"""The notebooks as files: committed without outputs, GPU cells tagged and guarded.

Running them is `python -m pytest --nbmake notebooks/` (each runs top to bottom on CPU).
"""
from __future__ import annotations

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
