"""`kvlab grade` on a folder of planted submissions of notebook 00 (its two tasks): solved, untouched,
wrong, a tampered checker, a printed fake [ok], invalid JSON, a cell that never ends, sys.exit, a cell
that asks for more memory than the limit, one that deletes the files around it, a kvlab of its own
put first on sys.path, one that kills its worker, and another notebook's content. Each submission is notebook 00 up to its tasks (the rest would only add
minutes), edited as a participant would."""

import copy
import csv
import json
import sys
from pathlib import Path

import pytest

from kvlab import grade as G
from kvlab.cli import main

ROOT = Path(__file__).resolve().parent.parent
SOLVED = {
    "kv_token_bytes": "    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element\n",
    "mla_bytes_per_token": "    return num_layers * (kv_lora_rank + rope_dim) * bytes_per_element\n",
}
WRONG = {  # the classic mistakes: query heads for KV heads; a latent per head
    "kv_token_bytes": "    return 2 * num_layers * num_heads * head_dim * bytes_per_element\n",
    "mla_bytes_per_token": "    return num_layers * num_heads * (kv_lora_rank + rope_dim) * bytes_per_element\n",
}


#: each submission's time limit: the others take 5-10 s on 2 busy cores (a wide margin for a slow CI
#: machine); the endless one runs until it
LIMIT_S = 45


def _base() -> dict:
    nb = json.loads((ROOT / "notebooks" / "00_memory_wall.ipynb").read_text())
    last = max(i for i, c in enumerate(nb["cells"]) if "check.mla_bytes_per_token(mla_bytes_per_token)" in "".join(c["source"]))
    nb["cells"] = nb["cells"][:last + 1]
    return nb


def _edit(nb: dict, bodies: dict | None = None, drop_checks: bool = False, extra: list[str] = ()) -> dict:
    nb = copy.deepcopy(nb)
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        for task, body in (bodies or {}).items():
            if f"def {task}(" in src:
                head, _, rest = src.partition(f"def {task}(")
                sig, _, _ = rest.partition("\n    raise NotImplementedError")
                tail = rest.split("\n\n\n", 1)[1] if "\n\n\n" in rest else ""
                src = head + f"def {task}(" + sig + "\n" + body + ("\n\n" + tail if tail else "")
        if drop_checks:
            src = "\n".join(line for line in src.splitlines() if not line.startswith("check."))
        cell["source"] = src
    for code in extra:
        nb["cells"].append({"cell_type": "code", "execution_count": None, "id": f"x{len(nb['cells'])}",
                            "metadata": {}, "outputs": [], "source": code})
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    base = _base()
    plant = {
        "solved": _edit(base, SOLVED),
        "untouched": base,
        "wrong": _edit(base, WRONG),
        "tampered": _edit(base, WRONG, drop_checks=True, extra=[
            "import kvlab.check, kvlab.sizing\n"
            "kvlab.check.kv_token_bytes = lambda fn: print('[ok] kv_token_bytes') or True\n"
            "kvlab.check.mla_bytes_per_token = lambda fn: True\n"
            "kvlab.sizing.kv_token_bytes = lambda *a: 0  # the reference, patched too\n"
            "print(kvlab.check.kv_token_bytes(kv_token_bytes))"]),
        "fake-ok": _edit(base, drop_checks=True, extra=[
            "print('[ok] kv_token_bytes: 16 cases')\nprint('[ok] mla_bytes_per_token: 5 cases')"]),
        "endless": _edit(base, SOLVED, extra=["while True:\n    pass"]),
        "exits": _edit(base, SOLVED, extra=["import sys\nsys.exit(3)", "print('still here')"]),
        # 12 GiB: more than --memory-gb 8, less than overcommit would refuse without a limit; if the limit
        # did not hold, the second line would run and spoil the answer
        "hog": _edit(base, SOLVED, extra=["hog = bytearray(12 * 2**30)\n"
                                          "def kv_token_bytes(*args):\n    return 0"]),
        "deleter": _edit(base, SOLVED, extra=["import os\nfor f in os.listdir('.'):\n    os.remove(f)"]),
        # a kvlab of its own beside the notebook, put first on sys.path, whose checkers pass anything
        "shadow": _edit(base, WRONG, extra=[
            "import os, sys\nos.makedirs('kvlab/check', exist_ok=True)\n"
            "open('kvlab/__init__.py', 'w').close()\n"
            "open('kvlab/check/__init__.py', 'w').write('kv_token_bytes = mla_bytes_per_token = lambda fn: "
            "print(\"[ok]\") or True\\n')\n"
            "open('kvlab/check/progress.py', 'w').write('is_learners = lambda fn: True\\n')\n"
            "sys.path.insert(0, os.getcwd())"]),
        # kills the worker that runs it, after writing a result file where the worker's would be
        "killer": _edit(base, WRONG, extra=[
            "import json, os, signal\n"
            "open('../result.json', 'w').write(json.dumps({'tasks': {'kv_token_bytes': ['pass', ''], "
            "'mla_bytes_per_token': ['pass', '']}, 'error': '', 'seconds': 1}))\n"
            "os.kill(os.getppid(), signal.SIGKILL)"]),
    }
    for who, nb in plant.items():
        (folder / who).mkdir()
        (folder / who / "00_memory_wall.ipynb").write_text(json.dumps(nb))
    (folder / "broken").mkdir()
    (folder / "broken" / "00_memory_wall.ipynb").write_text("{ this is not JSON")
    other = json.loads((ROOT / "notebooks" / "01_naive_cache.ipynb").read_text())
    (folder / "mixed-up").mkdir()
    (folder / "mixed-up" / "00_memory_wall.ipynb").write_text(json.dumps(other))
    points = folder.parent / "points.json"
    points.write_text(json.dumps({"kv_token_bytes": 2}))
    out, nbg = folder.parent / "grades.csv", folder.parent / "nbgrader.csv"
    import time

    t0 = time.perf_counter()
    assert main(["grade", str(folder), "--out", str(out), "--nbgrader", str(nbg), "--points", str(points),
                 "--timeout", str(LIMIT_S), "--jobs", "2"]) == 0
    took = time.perf_counter() - t0
    rows = {r["who"]: r for r in csv.DictReader(out.open())}
    return rows, list(csv.DictReader(nbg.open())), took


def test_every_row_is_as_expected(graded):
    rows, _, took = graded
    status = {who: (r["kv_token_bytes"], r["mla_bytes_per_token"]) for who, r in rows.items()}
    assert status["solved"] == ("pass", "pass") and rows["solved"]["score"] == "3" and rows["solved"]["max_score"] == "3"
    assert status["untouched"] == ("not attempted", "not attempted") and rows["untouched"]["score"] == "0"
    assert status["wrong"] == ("fail", "fail")
    assert rows["wrong"]["kv_token_bytes hint"].startswith("[fail] kv_token_bytes")
    assert status["tampered"] == ("fail", "fail") and rows["tampered"]["score"] == "0"  # the patches do not survive
    assert status["fake-ok"] == ("not attempted", "not attempted")  # printed [ok] lines are not read
    assert status["exits"] == ("pass", "pass") and rows["exits"]["error"] == ""  # sys.exit in a cell: the kernel lives
    # memory beyond the limit fails that cell alone (Linux); deleting files reaches only the scratch copy
    if sys.platform.startswith("linux"):
        assert status["hog"] == ("pass", "pass"), rows["hog"]
    assert status["deleter"] == ("pass", "pass") and Path(rows["deleter"]["file"]).exists()
    assert status["shadow"] == ("fail", "fail")  # the real kvlab graded it
    assert status["killer"] == ("not attempted", "not attempted") and rows["killer"]["error"].startswith(
        "the worker died")
    assert f"{LIMIT_S} s limit" in rows["endless"]["error"] and rows["endless"]["score"] == "0"
    assert rows["broken"]["error"].startswith("not a readable notebook") and rows["broken"]["max_score"] == "3"
    assert rows["mixed-up"]["error"] == "this is notebook 01's content, submitted as 00_memory_wall"
    assert all(r["notebook"] == "00_memory_wall" for r in rows.values())
    # the endless cell is stopped at its limit; two at a time, the folder takes well under a minute each
    assert float(rows["endless"]["seconds"]) <= LIMIT_S + 30 and took < 9 * 60
    # a participant's own heading above the title does not hide which notebook it is
    nb = _base()
    nb["cells"].insert(0, {"cell_type": "markdown", "id": "me", "metadata": {}, "source": "Name: Alice"})
    assert G._title_number(nb) == "00"


def test_the_nbgrader_export_has_its_columns(graded):
    rows, nbg, _ = graded
    assert tuple(nbg[0]) == G.NBGRADER_COLUMNS
    by = {r["student_id"]: r for r in nbg}
    assert by["solved"]["score"] == "3" and by["solved"]["max_score"] == "3" and by["solved"]["assignment"] == "00_memory_wall"
    assert set(by) == set(rows)


def test_bad_input_is_named(tmp_path, capsys):
    assert main(["grade", str(tmp_path), "--out", str(tmp_path / "g.csv")]) == 2
    assert "no .ipynb found" in capsys.readouterr().err
    (tmp_path / "p.json").write_text(json.dumps({"nope": 1}))
    assert main(["grade", str(tmp_path), "--out", str(tmp_path / "g.csv"), "--points", str(tmp_path / "p.json")]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert main(["grade", str(tmp_path), "--out", str(tmp_path / "g.csv"), "--notebook", "99_x"]) == 2
    assert "--notebook must be one of" in capsys.readouterr().err
    with pytest.raises(ValueError, match="jobs must be an int >= 1"):
        G.grade([tmp_path], jobs=0)


def test_every_task_s_function_is_the_one_its_notebook_passes_to_its_checker():
    import re

    for task, (notebook, _, _) in G.EXERCISES.items():
        nb = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())
        text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        assert re.search(rf"check\.{task}\({G.function_name(task)}\)", text), (task, G.function_name(task))
        assert re.search(rf"^def {G.function_name(task)}\(", text, re.M), task
