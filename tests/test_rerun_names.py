"""Re-running a cell after Run All reads the names as the LAST cell left them: no notebook cell may read a
name that a later cell binds to something else (tests/notebook_names.py; no kernel needed)."""

import json
from pathlib import Path

import pytest

from notebook_names import rebinding_hazards

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_reads_a_name_a_later_cell_rebinds(path):
    assert rebinding_hazards(path) == []


def _notebook(tmp_path, *sources):
    cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": s}
             for s in sources]
    path = tmp_path / "planted.ipynb"
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_the_two_rebindings_rooms_met_are_found(tmp_path):
    # 02: a later cell rebinds the block manager the Task 1 read-back uses
    p = _notebook(tmp_path, "bm = BlockManager(12, 4)", "back = read(bm)", "bm = BlockManager(64, 16)")
    assert rebinding_hazards(p) == ["cell 1 reads 'bm' (bound by cell 0), rebound later by cell 2"]
    # 05: a later loop variable overwrites a list the kernel cells read
    p = _notebook(tmp_path, "ctx = [5, 37, 70]", "out = kernel(q, ctx)", "for i, ctx in enumerate(xs):\n    pass")
    assert len(rebinding_hazards(p)) == 1


@pytest.mark.parametrize("later", [
    "import torch",  # the same import again
    "def f():\n    bm = 3\n    return bm",  # a function's own local
    "[bm for bm in range(3)]",  # a comprehension's own variable
    "bm.append(4)",  # a mutation binds no name
    "bm = [1, 2]",  # the same statement as the first binding
])
def test_what_is_not_a_rebinding(tmp_path, later):
    p = _notebook(tmp_path, "import torch\nbm = [1, 2]", "print(bm, torch)", later)
    assert rebinding_hazards(p) == []


def test_a_cell_that_binds_before_it_reads_is_safe(tmp_path):
    p = _notebook(tmp_path, "r = 1", "r = 2\nprint(r)", "r = 3")
    assert rebinding_hazards(p) == []
