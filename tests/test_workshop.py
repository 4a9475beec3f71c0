"""Every notebook fits a workshop slot (issue 44): a main path of at most 1,500 words of prose before
`## Going deeper`, at most 3,500 in all, and at least three build tasks (00 and 06: two), each a
`### Task N` heading on the main path whose checker is listed in `kvlab.check.EXERCISES` and has a
reference answer for `check.solution`."""

import json
import re
from pathlib import Path

import pytest

from kvlab.check import EXERCISES
from notebook_names import long_code_cells
from kvlab.check.solutions import REFERENCES

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
MAIN_WORDS, TOTAL_WORDS = 1500, 3500
MIN_TASKS = {"00_memory_wall": 2, "06_putting_it_together": 2}  # the rest: 3
# notebooks whose build tasks are still being written (issue 44): strict, so finishing one fails here
# until it leaves this set
TASKS_PENDING: set[str] = set()
WORDS_PENDING: set[str] = set()
# issue 55: no main-path code cell over 25 lines (what a cell computes for a verdict lives in kvlab). The
# cells still over it, per notebook: strict, so shortening one fails here until its count is lowered
LONG_CELL_LINES = 25
LONG_CELLS_PENDING: dict[str, int] = {}


def words(path: Path) -> tuple[int, int]:
    """(main-path words, total words) of a notebook's markdown; the main path ends at `## Going deeper`."""
    main = total = 0
    deeper = False
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        deeper = deeper or bool(re.search(r"^## Going deeper", text, re.M))
        n = len(text.split())
        total += n
        main += 0 if deeper else n
    return main, total


def tasks(path: Path) -> list[tuple[str, str]]:
    """(task heading, checker called by the next code cell) for every `### Task` on the main path."""
    out, heading = [], None
    for cell in json.loads(path.read_text())["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            if re.search(r"^## Going deeper", text, re.M):
                break
            m = re.search(r"^### (Task \d+)", text, re.M)
            heading = m.group(1) if m else heading
        elif heading:
            calls = [c for c in re.findall(r"check\.(\w+)\(", text) if c not in ("use", "solution", "progress")]
            out.append((heading, calls[0] if calls else ""))
            heading = None
    return out


def _pending(names: set, why: str):
    return [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=why)) if p.stem in names else p
            for p in NOTEBOOKS]


@pytest.mark.parametrize("path", _pending(WORDS_PENDING, "prose not cut yet (issue 44)"), ids=lambda p: p.stem)
def test_the_main_path_fits_a_slot(path):
    main, total = words(path)
    assert main <= MAIN_WORDS and total <= TOTAL_WORDS, f"{path.stem}: {main} main-path words, {total} in all"
    cells = json.loads(path.read_text())["cells"]
    last = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and "## Going deeper" in "".join(c["source"])]
    # Going deeper closes the notebook: no section after it. Its cells may compute (issue 55: second
    # readings, rescalings and simulations go there), under its own `### ` headings at most
    assert last and not any(re.search(r"^## ", "".join(c["source"]), re.M) for c in cells[last[0] + 1:]
                            if c["cell_type"] == "markdown"), "Going deeper closes the notebook"


@pytest.mark.parametrize("path", _pending(TASKS_PENDING, "build tasks not written yet (issue 44)"), ids=lambda p: p.stem)
def test_the_participant_builds_the_layer(path):
    found = tasks(path)
    assert len(found) >= MIN_TASKS.get(path.stem, 3), f"{path.stem}: {found}"
    for heading, checker in found:
        assert checker in EXERCISES, f"{path.stem} {heading}: its cell calls no listed checker ({checker!r})"
        assert EXERCISES[checker][:2] == (path.stem, heading), (checker, EXERCISES[checker])
        assert checker in REFERENCES, f"{checker}: no reference answer for check.solution"


def test_words_counts_the_main_path_and_the_whole(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": ["one two three"]}, {"cell_type": "code", "source": ["x = 1"]},
                    {"cell_type": "markdown", "source": ["## Going deeper\n", "- four five"]}]}
    path = tmp_path / "x.ipynb"
    path.write_text(json.dumps(nb))
    assert words(path) == (3, 9)  # "##" and "-" count as words: a stable, slightly strict count


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_every_task_has_a_printable_solution(name, capsys):
    """check.solution prints kvlab's answer, source and file, for every task (the kernels' need triton)."""
    from kvlab import check, kernels

    if name in ("block_walk", "online_softmax_update", "dequant_int8") and not kernels.available():
        pytest.skip(kernels.WHY_NO_TRITON)
    check.solution(name)
    out = capsys.readouterr().out
    head, body = out.split("\n", 1)
    assert head.startswith(f"# kvlab's answer to {name!r}") and ".py)" in head and "def " in body
    path = head.rsplit("(", 1)[1].rstrip(")")
    assert (Path(__file__).resolve().parent.parent / path).is_file(), path


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_main_path_code_cells_stay_short(path):
    long = long_code_cells(path, LONG_CELL_LINES)
    assert len(long) == LONG_CELLS_PENDING.get(path.stem, 0), (
        f"{path.stem}: main-path code cells over {LONG_CELL_LINES} lines (index, lines) {long}; "
        f"LONG_CELLS_PENDING expects {LONG_CELLS_PENDING.get(path.stem, 0)}: lower it when you shorten one")
