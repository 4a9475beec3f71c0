"""Kept parts (issue 56): a participant's function that passes its checker is kept (its source, the task,
the kvlab version, the time), the latest pass wins, ``check.mine()`` lists them, ``check.forget`` drops one;
nothing kept runs at ``import kvlab``, and a part written for another version of its task, or a damaged
record, is refused by name in one line."""

import json
import os
import subprocess
import sys

import pytest

from kvlab import check, kernels
from kvlab.check import kept

if kernels.available():  # Linux; elsewhere the kernel part's test is skipped (tests/conftest.py)
    import triton
    import triton.language as tl  # a @triton.jit function must see `tl` among its module's globals

    @triton.jit
    def dequant(codes, scale):  # a participant's answer to 05 Task 3, in registers
        return codes.to(tl.float32) * scale


def slot_mapping(block_table, block_size, start, end):  # a participant's answer to 02 Task 1
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def wrong_slot_mapping(block_table, block_size, start, end):  # the classic slip: end included
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end + 1)]


def grow(cached, new):  # 01 Task 1
    import torch
    return new if cached is None else torch.cat([cached, new], dim=-2)


def test_a_passing_function_is_kept_and_runs_again(capsys):
    assert check.slot_mapping(slot_mapping)
    rec = json.loads(kept.kept_file().read_text())["slot_mapping"]
    assert rec["name"] == "slot_mapping" and rec["signature"] == list(kept.SIGNATURES["slot_mapping"])
    assert "def slot_mapping(block_table, block_size, start, end)" in rec["source"] and rec["kvlab"]
    again = kept.part("slot_mapping")
    assert again is not slot_mapping and again([7, 2], 4, 2, 7) == slot_mapping([7, 2], 4, 2, 7)
    assert kept.part("grow") is None  # nothing kept for it
    capsys.readouterr()
    mine = check.mine()
    out = capsys.readouterr().out
    assert mine["slot_mapping"][0] == "slot_mapping" and mine["grow"] is None
    assert f"your parts kept: 1 of {len(kept.SIGNATURES)}" in out and "02 Task 1" in out and "slot_mapping() kept" in out


def test_only_a_pass_is_kept_and_the_latest_pass_wins(capsys):
    assert not check.slot_mapping(wrong_slot_mapping)
    assert not kept.kept_file().exists()  # a failing function is not kept
    assert check.grow(grow)
    assert check.slot_mapping(slot_mapping)

    def slot_mapping_again(block_table, block_size, start, end):  # a second answer, passing too
        return [block_table[i // block_size] * block_size + i % block_size for i in range(start, end)]
    assert check.slot_mapping(slot_mapping_again)
    assert kept.part("slot_mapping").__name__ == "slot_mapping_again"
    check.forget("grow")
    assert check.use("grow", grow) is grow and kept.part("grow") is not None  # check.use keeps it too
    assert set(json.loads(kept.kept_file().read_text())) == {"grow", "slot_mapping"}
    assert not check.slot_mapping(wrong_slot_mapping)  # a later failure leaves the kept pass alone
    assert kept.part("slot_mapping").__name__ == "slot_mapping_again"
    from kvlab.quant.core import quantize_per_head  # kvlab's own passes its checker, and is never kept
    assert check.quantize_per_head(quantize_per_head)
    assert "quantize_per_head" not in json.loads(kept.kept_file().read_text())


def test_forget_drops_one_and_refuses_an_unknown_name(capsys):
    assert check.slot_mapping(slot_mapping) and check.grow(grow)
    assert check.forget("slot_mapping") is True
    assert kept.part("slot_mapping") is None and kept.part("grow") is not None
    assert check.forget("slot_mapping") is False
    before = kept.kept_file().read_text()
    with pytest.raises(ValueError, match="build tasks"):
        check.forget("slot_mappings")
    assert kept.kept_file().read_text() == before  # bad input changes nothing


def test_a_stale_signature_and_a_damaged_record_are_refused_by_name(capsys):
    assert check.slot_mapping(slot_mapping) and check.grow(grow)
    data = json.loads(kept.kept_file().read_text())
    data["slot_mapping"]["signature"] = ["block_table", "block_size", "num_tokens"]  # another kvlab's task
    data["grow"] = {"name": "grow"}  # damaged: no source
    kept.kept_file().write_text(json.dumps(data))
    capsys.readouterr()
    assert kept.part("slot_mapping") is None and kept.part("grow") is None
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[refused] your slot_mapping (02 Task 1): written for another version of the task")
    assert lines[1].startswith("[refused] your grow (01 Task 1): its record is damaged")
    mine = check.mine()
    assert mine["slot_mapping"] is None and mine["grow"] is None
    kept.kept_file().write_text("{not json")  # a damaged file: warned about, nothing kept
    assert kept.part("grow") is None and check.mine()["grow"] is None


def test_nothing_kept_runs_when_kvlab_is_imported(tmp_path):
    """A kept source that would write a file if it ran: importing kvlab and kvlab.check runs none of it."""
    marker = tmp_path / "ran"
    store = tmp_path / "kept_parts.json"
    source = f"open({str(marker)!r}, 'w').write('x')\ndef grow(cached, new):\n    return new\n"
    store.write_text(json.dumps({"grow": {"name": "grow", "source": source, "signature": ["cached", "new"],
                                          "jit": False, "kvlab": "0.1.0", "kept": "2026-12-07T08:00"}}))
    env = dict(os.environ, KVLAB_KEPT=str(store))
    code = "import kvlab, kvlab.check; kvlab.check.mine()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"your parts kept: 1 of {len(kept.SIGNATURES)}" in out.stdout and not marker.exists()


def test_every_task_has_a_signature():
    assert set(kept.SIGNATURES) == set(check.EXERCISES)


@pytest.mark.parametrize("damage", [None, 5, ["a", 1], "x", {"jit": True}], ids=["null", "int", "mixed", "str", "jit"])
def test_every_kind_of_damage_is_one_refusal_line(capsys, damage):
    assert check.grow(grow)
    data = json.loads(kept.kept_file().read_text())
    if isinstance(damage, dict):
        data["grow"].update(damage)  # a plain task's part that claims to be a kernel
    else:
        data["grow"]["signature"] = damage
    kept.kept_file().write_text(json.dumps(data))
    capsys.readouterr()
    assert kept.part("grow") is None and check.mine()["grow"] is None
    out = capsys.readouterr().out
    assert out.startswith("[refused] your grow (01 Task 1): its record is damaged") and "your parts kept: 0 of" in out


def test_an_unreadable_file_is_set_aside_and_a_failed_forget_says_so(capsys, monkeypatch):
    assert check.grow(grow)
    path = kept.kept_file()
    path.write_text("{half-writ")
    assert kept.part("grow") is None
    assert path.with_name(path.name + ".bad").read_text() == "{half-writ"  # the participant's code is not lost
    assert check.grow(grow) and kept.part("grow") is not None
    monkeypatch.setattr(kept, "write_atomic", lambda *a, **k: (_ for _ in ()).throw(ValueError("read-only")))
    assert check.forget("grow") is False and kept.part("grow") is not None  # still kept: it said so
    assert "could not forget your grow" in capsys.readouterr().err


def test_a_function_without_source_passes_and_says_it_was_not_kept(capsys):
    namespace = {}
    exec("def grow(cached, new):\n    import torch\n    return new if cached is None else torch.cat([cached, new], -2)",
         namespace)
    assert check.grow(namespace["grow"])  # the pass stands
    assert "passed but was not kept" in capsys.readouterr().err and kept.part("grow") is None


@pytest.mark.triton
def test_a_kernel_part_comes_back_as_a_kernel_that_passes_again(capsys):
    """A @triton.jit part is compiled back where Triton can read its source: it passes its checker again."""
    assert check.dequant_int8(dequant)
    again = kept.part("dequant_int8")
    assert again is not None and again is not dequant and hasattr(again, "fn")
    assert check.dequant_int8(again)


def test_the_signatures_are_the_notebooks_stubs():
    """Each task's parameters as its notebook's stub declares them (05's online softmax stub is my_update)."""
    import ast
    root = kept.Path(__file__).resolve().parent.parent / "notebooks"
    found = {}
    for path in sorted(root.glob("0*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            try:
                tree = ast.parse("".join(cell["source"]))
            except SyntaxError:  # a cell with IPython magics
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef):
                    task = "online_softmax_update" if node.name == "my_update" else node.name
                    if task in kept.SIGNATURES and task not in found:
                        found[task] = tuple(a.arg for a in node.args.args)
    assert found == kept.SIGNATURES


def test_a_changed_control_flow_is_not_the_code_that_passed():
    """Jumps compare by where they land: a statement moved out of an if is another function."""
    src = "def f(x):\n    if x:\n        x = x + 1\n        x = x * 2\n    return x\n"
    moved = "def f(x):\n    if x:\n        x = x + 1\n    x = x * 2\n    return x\n"
    ns = {}
    exec(compile(src, "<f>", "exec"), ns)
    assert kept._same_code(src, ns["f"]) and not kept._same_code(moved, ns["f"])
