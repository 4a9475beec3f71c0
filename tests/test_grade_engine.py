"""`kvlab grade`'s engine column (issue 56 item 4): notebook 06's engine assembled from the parts each
participant's submissions passed, served beside kvlab's: "yes" when every answer equals kvlab's, token for
token; built from the submissions' own functions, never from the kept parts of the grader's home."""

import csv
import json
from pathlib import Path

from kvlab import grade as G
from kvlab.check import kept
from kvlab.cli import main

ROOT = Path(__file__).resolve().parent.parent
SOLVED = {
    "slot_mapping": "    return [block_table[t // block_size] * block_size + t % block_size for t in range(start, end)]\n",
    "append_slot": ("    copy = None\n    if num_tokens % block_size == 0:\n        block_table.append(take_block())\n"
                    "    elif ref_count(block_table[-1]) > 1:\n        copy = (block_table[-1], take_block())\n"
                    "        block_table[-1] = copy[1]\n"
                    "    return block_table[-1] * block_size + num_tokens % block_size, copy\n"),
    "prefix_hits": ("    hits, key = [], None\n    for i in range((len(token_ids) - 1) // block_size):\n"
                    "        key = block_hash(key, token_ids[i * block_size:(i + 1) * block_size])\n"
                    "        if key not in cached:\n            break\n        hits.append(cached[key])\n    return hits\n"),
    "quantize_static": "    return torch.clamp(torch.round(x.float() / scale), -127, 127).to(torch.int8)\n",
    "admission_rule": ("    if budget_left <= 0:\n        return 'token budget'\n    if num_running >= max_num_seqs:\n"
                       "        return 'seq limit'\n"
                       "    if blocks_needed > blocks_free - (watermark_blocks if num_running else 0):\n"
                       "        return 'no blocks'\n    return None\n"),
    "chunk_prefills": ("    out = []\n    for n in uncomputed:\n        out.append(min(n, budget))\n"
                       "        budget -= out[-1]\n    return out\n"),
}


def _submission(notebook: str, solved) -> dict:
    """The notebook cut to its title, its set-up cell and its task cells, the ``solved`` ones answered."""
    nb = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())
    tasks = []
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and "    raise NotImplementedError" in src:
            name = src.split("def ", 1)[1].split("(", 1)[0]
            if name in solved:
                head, _, rest = src.partition("    raise NotImplementedError")
                src = head + SOLVED[name] + rest.split("\n", 1)[1]
            tasks.append({**cell, "source": src, "outputs": []})
    setup = {**nb["cells"][1], "source": "".join(nb["cells"][1]["source"]) + "\nfrom kvlab import check\nimport torch\n"}
    nb["cells"] = [nb["cells"][0], setup] + tasks
    return nb


def test_the_engine_column_is_built_from_the_submissions_own_parts(tmp_path, monkeypatch):
    folder = tmp_path / "submissions"
    plant = {"alice": {"02_paged_blocks": ["slot_mapping", "append_slot", "prefix_hits"]},
             "bob": {"02_paged_blocks": []}}
    for who, books in plant.items():
        (folder / who).mkdir(parents=True)
        for book, solved in books.items():
            (folder / who / f"{book}.ipynb").write_text(json.dumps(_submission(book, solved)))
    # the grader's own home keeps a wrong admission rule, a part alice did not pass: her engine must not have it
    home = tmp_path / "home-kept.json"
    monkeypatch.setenv("KVLAB_KEPT", str(home))

    def admission_rule(num_running, max_num_seqs, budget_left, blocks_needed, blocks_free, watermark_blocks):
        return None  # admits everything
    kept.keep("admission_rule", admission_rule)
    assert "admission_rule" in json.loads(home.read_text())
    out = tmp_path / "grades.csv"
    assert main(["grade", str(folder), "--out", str(out), "--timeout", "120", "--jobs", "2"]) == 0
    rows = list(csv.DictReader(out.open()))
    by = {(r["who"], r["notebook"]): r for r in rows}
    alice = by["alice", "02_paged_blocks"]
    assert alice["slot_mapping"] == alice["append_slot"] == alice["prefix_hits"] == "pass"
    for book in plant["alice"]:
        r = by["alice", book]
        assert r["engine"] == "yes", r["engine detail"]
        assert r["engine detail"].startswith("3 of 7 parts theirs; your engine against kvlab's on the same "  # not 4
                                             f"{16} requests: answers equal 16/16")
    bob = by["bob", "02_paged_blocks"]
    assert bob["slot_mapping"] == "not attempted" and bob["engine"] == "-"
    assert json.loads(home.read_text()).keys() == {"admission_rule"}  # the grader's file is untouched


def test_a_worker_that_fails_is_a_question_mark_and_the_grades_stand(monkeypatch):
    """The engine's worker failing (here: a model it cannot load) marks the column "?", saying why."""
    rows = [G.Row(who="carol", file="x", kept={"slot_mapping": {"name": "slot_mapping"}}), G.Row(who="dave", file="y")]
    G.grade_engines(rows, model="no-such-model")
    assert rows[0].engine == "?" and rows[0].engine_detail.startswith("the engine's worker failed: ")
    assert "no-such-model" in rows[0].engine_detail and rows[1].engine == "-"
