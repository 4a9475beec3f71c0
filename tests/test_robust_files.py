"""Files in, one-line errors out; nothing half-written; caches kvlab owns heal themselves.

Every path kvlab reads or writes is tried the ways a workshop gets it wrong: missing, a folder,
empty, binary, not UTF-8, another program's file, another model's calibration, a path under a
regular file. The CLI must answer each with ONE ``kvlab: error:`` line naming the file and exit
status 2. Kill tests SIGKILL a real ``kvlab calibrate`` / ``kvlab ppl`` in the middle of its write
and check that nothing a later run reads is damaged.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvlab.calibrate import calibrate, default_calibration
from kvlab.cli import main
from kvlab.files import FileError, read_text, write_atomic
from kvlab.quant.calibration import Calibration

TINY_CAL_ARGS = ["--model", "tiny", "--tokens", "256", "--chunk", "128"]


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvlab", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def one_line_error(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, text
    assert lines[0].startswith("kvlab: error: ") and "Traceback" not in text, text
    return lines[0]


@pytest.fixture(scope="module")
def tiny_cal(tiny):
    model, tok = tiny
    from kvlab.data import calibration_chunks

    return calibrate(model, calibration_chunks(tok, 256, 128), progress=False, meta={"model": "tiny"})


# ---- the two cases, as a learner meets them: the real command in a subprocess --------------

def test_scales_file_that_is_not_safetensors(tmp_path):
    f = tmp_path / "scales.safetensors"
    f.write_text("this is a text file\n")
    r = run_cli("ppl", "--model", "tiny", "--scales-file", str(f))
    assert r.returncode == 2
    line = one_line_error(r.stderr)
    assert str(f) in line and "is not a safetensors file" in line


def test_calibrate_out_under_a_regular_file(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    out = tmp_path / "notes.txt" / "cal.safetensors"
    t0 = time.perf_counter()
    r = run_cli("calibrate", *TINY_CAL_ARGS, "--out", str(out))
    assert r.returncode == 2
    line = one_line_error(r.stderr)
    assert str(out) in line and "is a file, not a folder" in line
    assert time.perf_counter() - t0 < 60  # refused before any calibration work


# ---- every file argument, every way it can be wrong -------------------------------------------------

def _make(tmp_path, what, tiny_cal):
    """Create the bad input ``what`` under tmp_path and return its path."""
    p = tmp_path / "input"
    if what == "missing":
        return tmp_path / "no-such-file"
    if what == "folder":
        p.mkdir()
    elif what == "empty":
        p.write_bytes(b"")
    elif what == "whitespace":
        p.write_text(" \n\t\n")
    elif what == "latin-1":
        p.write_bytes("Ophélie chante; le prince rêve.\n".encode("latin-1"))
    elif what == "binary":
        p.write_bytes(bytes(range(256)) * 4)
    elif what == "text":
        p.write_text("To be, or not to be: that is the question.\n")
    elif what == "truncated":
        tiny_cal.save(p)
        p.write_bytes(p.read_bytes()[:300])
    elif what == "other tensors":
        from safetensors.torch import save_file

        save_file({"weight": torch.ones(3, 3)}, str(p))
    elif what == "nan scales":
        bad = Calibration({t: {g: dict(s) for g, s in gs.items()} for t, gs in tiny_cal.stats.items()}, tiny_cal.meta)
        bad.stats["k"]["per-head"]["absmax"] = torch.full_like(bad.stats["k"]["per-head"]["absmax"], float("nan"))
        bad.save(p)
    else:
        raise AssertionError(what)
    return p


SCALES_CASES = [("missing", "does not exist"), ("folder", "is a folder"), ("empty", "is empty"),
                ("text", "is not a safetensors file"), ("binary", "is not a safetensors file"),
                ("truncated", "is not a safetensors file"), ("other tensors", "is not a kvlab calibration file"),
                ("nan scales", "is damaged")]
TEXT_CASES = [("missing", "does not exist"), ("folder", "is a folder"), ("empty", "is empty"),
              ("whitespace", "only whitespace"), ("latin-1", "is not UTF-8 text"), ("binary", "is a binary file")]


@pytest.mark.parametrize("what,message", SCALES_CASES)
@pytest.mark.parametrize("command", ["ppl", "export-vllm"])
def test_scales_file_cli(tmp_path, capsys, tiny_cal, command, what, message):
    f = _make(tmp_path, what, tiny_cal)
    extra = ["--out", str(tmp_path / "export")] if command == "export-vllm" else []
    assert main([command, "--model", "tiny", "--scales-file", str(f), *extra]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert message in line and str(f) in line
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("what,message", SCALES_CASES)
def test_calibration_load_api(tmp_path, tiny_cal, what, message):
    with pytest.raises(FileError, match=message):
        Calibration.load(_make(tmp_path, what, tiny_cal))


@pytest.mark.parametrize("what,message", TEXT_CASES)
@pytest.mark.parametrize("command", ["ppl", "calibrate"])
def test_text_file_cli(tmp_path, capsys, tiny_cal, command, what, message):
    f = _make(tmp_path, what, tiny_cal)
    extra = ["--out", str(tmp_path / "cal.safetensors")] if command == "calibrate" else []
    assert main([command, "--model", "tiny", "--file", str(f), *extra]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert message in line and str(f) in line
    assert not (tmp_path / "cal.safetensors").exists()


def test_text_file_of_one_token(tiny, tmp_path):
    from kvlab.data import text_tokens_from_file

    f = tmp_path / "short.txt"
    f.write_text("x")
    with pytest.raises(FileError, match="fewer than 2 tokens"):
        text_tokens_from_file(tiny[1], f)


def test_another_models_calibration(tmp_path, capsys, tiny, tiny_cal):
    """Scales taken on another model: refused by the CLI, the engine and the quantized pool alike."""
    from kvlab.engine import LLM
    from kvlab.models import tiny_llama
    from kvlab.quant import named_config

    wide = tiny_llama(num_key_value_heads=4, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"taken on a model with 3 x 2 x 16 .* this model has 3 x 4 x 16"):
        LLM(wide, None, num_blocks=8, block_size=4, quant_config=named_config("int8"), calibration=tiny_cal)
    f = tmp_path / "tiny.safetensors"
    tiny_cal.save(f)
    deep = tiny_llama(num_hidden_layers=4)
    with pytest.raises(ValueError, match="this model has 4 x 2 x 16"):
        from kvlab.eval import evaluate

        evaluate(deep, list(range(3, 80)), {"q": named_config("int8")}, Calibration.load(f), window=32, stride=16,
                 chunk=8)
    with pytest.raises(TypeError, match="calibration must be a kvlab Calibration"):
        LLM(tiny[0], None, num_blocks=8, block_size=4, quant_config=named_config("int8"), calibration=str(f))


@pytest.mark.parametrize("what,message", [
    ("empty folder", "has no config.json"),
    ("bad json", "config.json' is not valid JSON"),
    ("no model_type", "config.json has no model_type"),
    ("no weights", "has no *.safetensors weights"),
    ("truncated weights", "could not load model folder"),
])
def test_model_folder(tmp_path, capsys, tiny, what, message):
    folder = tmp_path / "model"
    folder.mkdir()
    if what != "empty folder":
        tiny[0].config.save_pretrained(folder)
    if what == "bad json":
        (folder / "config.json").write_text('{"model_type": "llama",')
    elif what == "no model_type":
        (folder / "config.json").write_text('{"hidden_size": 64}')
    elif what == "truncated weights":
        tiny[0].save_pretrained(folder)
        w = folder / "model.safetensors"
        w.write_bytes(w.read_bytes()[:1000])
    assert main(["generate", "--model", str(folder), "--prompt", "hi"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert message in line and str(folder) in line
    if what in ("empty folder", "bad json", "no model_type"):  # the size calculator reads only config.json
        assert main(["size", "--model", str(folder)]) == 2
        assert message in one_line_error(capsys.readouterr().err)


# ---- paths that cannot be written -------------------------------------------------------------------

@pytest.mark.parametrize("command", ["calibrate", "export-vllm", "bench-kernels"])
@pytest.mark.parametrize("where", ["under a file", "a folder"])
def test_unwritable_out(tmp_path, capsys, tiny_cal, command, where):
    (tmp_path / "file.txt").write_text("x")
    if where == "under a file":
        out = tmp_path / "file.txt" / "out"
    else:
        out = tmp_path / "folder"
        out.mkdir()
        if command == "export-vllm":  # a folder is what it wants; its files can not be folders
            (out / "config.json").mkdir()
    scales = tmp_path / "cal.safetensors"
    tiny_cal.save(scales)
    argv = {"calibrate": ["calibrate", *TINY_CAL_ARGS, "--out", str(out)],
            "export-vllm": ["export-vllm", "--model", "tiny", "--scales-file", str(scales), "--out", str(out)],
            "bench-kernels": ["bench", "kernels", "--batches", "1", "--contexts", "64", "--out", str(out)]}[command]
    assert main(argv) == 2
    line = one_line_error(capsys.readouterr().err)
    assert str(out) in line or str(out / "config.json") in line
    assert "cannot" in line or "not a folder" in line


def test_kvlab_cache_is_a_file(tmp_path, capsys, monkeypatch):
    f = tmp_path / "cache"
    f.write_text("not a folder")
    monkeypatch.setenv("KVLAB_CACHE", str(f))
    assert main(["ppl", "--model", "tiny", "--tokens", "64", "--window", "32", "--stride", "16", "--chunk", "8"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "cannot write calibration file" in line and str(f) in line


def test_write_atomic_leaves_no_temporary_file(tmp_path):
    p = write_atomic(tmp_path / "a" / "b.json", '{"x": 1}')
    assert json.loads(p.read_text()) == {"x": 1} and os.listdir(tmp_path / "a") == ["b.json"]
    assert read_text(p) == '{"x": 1}'


# ---- caches kvlab owns heal with one warning line ---------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "another model"])
def test_corrupt_cached_calibration_is_rebuilt_with_one_warning(tiny, tmp_path, monkeypatch, capsys, damage):
    from kvlab.models import tiny_llama

    model, tok = tiny
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    good = default_calibration(model, tok, "tiny", tokens=256, progress=False)
    (path,) = (tmp_path / "calibration").glob("*.safetensors")
    capsys.readouterr()
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(os.urandom(4096))
    else:
        other = tiny_llama(num_hidden_layers=2)
        calibrate(other, [list(range(3, 67))], progress=False).save(path)
    cal = default_calibration(model, tok, "tiny", tokens=256, progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvlab: warning: ") and err[0].endswith("; recalibrating")
    assert str(path) in err[0]
    assert torch.equal(cal.stats["k"]["per-head"]["absmax"], good.stats["k"]["per-head"]["absmax"])
    default_calibration(model, tok, "tiny", tokens=256, progress=False)  # healed: silent from now on
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_corrupt_converted_model_is_converted_again(tmp_path, monkeypatch, capsys, smollm2):
    from kvlab.models import load_model, smollm2_folder

    real = smollm2_folder()
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    shutil.copytree(real, smollm2_folder())
    w = smollm2_folder() / "model.safetensors"
    w.write_bytes(w.read_bytes()[: 1 << 20])  # a kill in the middle of the old, non-atomic conversion
    (tmp_path / "models" / "smollm2-135m.tmp424242").mkdir()  # and a leftover of a killed conversion
    model, tok = load_model("smollm2-135m")
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if ln.startswith("kvlab: warning:")]
    assert len(warnings) == 1 and "converting the model again" in warnings[0] and str(smollm2_folder()) in warnings[0]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["smollm2-135m"]
    ref_model, _ = smollm2
    ids = torch.tensor([tok.encode("The capital of France is")])
    assert torch.equal(model(ids).logits.argmax(-1), ref_model(ids).logits.argmax(-1))


# ---- kill tests: SIGKILL in the middle of the write, or at a random moment --------------------------

KILLER = textwrap.dedent("""
    import os, signal, sys
    import kvlab.files as files
    mode = sys.argv[1]
    if mode == "half-written":  # die with half the bytes on disk
        def _write_all(f, data):
            f.write(data[: len(data) // 2]); f.flush(); os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        files._write_all = _write_all
    elif mode == "before-rename":  # die with the whole new file written under its temporary name
        def replace(src, dst):
            os.kill(os.getpid(), signal.SIGKILL)
        files.os.replace = replace
    from kvlab.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def _killed(mode, *argv, env=None):
    r = subprocess.run([sys.executable, "-c", KILLER, mode, *argv], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    assert r.returncode == -signal.SIGKILL, r.stderr
    return r


@pytest.mark.parametrize("mode", ["half-written", "before-rename"])
def test_calibrate_out_killed_mid_write_keeps_the_old_file(tmp_path, tiny_cal, mode):
    out = tmp_path / "cal.safetensors"
    tiny_cal.save(out)
    old = out.read_bytes()
    _killed(mode, "calibrate", *TINY_CAL_ARGS, "--tokens", "384", "--out", str(out))
    assert out.read_bytes() == old  # the old file, whole
    Calibration.load(out)
    r = run_cli("calibrate", *TINY_CAL_ARGS, "--tokens", "384", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert Calibration.load(out).meta["tokens"] == 384
    assert sorted(os.listdir(tmp_path)) == ["cal.safetensors"]  # the dead run's temporary file is gone too


def test_calibrate_out_killed_at_random_moments(tmp_path):
    """SIGKILL after a random delay: the file is absent or whole, and a later run succeeds."""
    out = tmp_path / "cal.safetensors"
    t0 = time.perf_counter()
    r = run_cli("calibrate", *TINY_CAL_ARGS, "--out", str(out))
    assert r.returncode == 0, r.stderr
    full = time.perf_counter() - t0
    out.unlink()
    rng = random.Random(11)
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-m", "kvlab", "calibrate", *TINY_CAL_ARGS, "--out", str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, full))
        p.send_signal(signal.SIGKILL)
        p.wait()
        if out.exists():
            Calibration.load(out)  # whole, or not there at all
    r = run_cli("calibrate", *TINY_CAL_ARGS, "--out", str(out))
    assert r.returncode == 0, r.stderr
    Calibration.load(out)


def test_default_calibration_killed_mid_write_then_ppl_runs(tmp_path):
    env = {"KVLAB_CACHE": str(tmp_path)}
    ppl = ["ppl", "--model", "tiny", "--kv-cache-dtype", "int8", "--tokens", "64", "--window", "32", "--stride", "16",
           "--chunk", "8", "--json"]
    _killed("half-written", *ppl, env=env)
    cal_dir = tmp_path / "calibration"
    assert not list(cal_dir.glob("*.safetensors"))  # no half file under the name a later run reads
    r = run_cli(*ppl, env=env)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr and json.loads(r.stdout)["config"]
    assert [p.name for p in cal_dir.iterdir()] == ["tiny-twelfth-night-2048.safetensors"]


def test_corrupt_progress_file_warns_once_and_is_rewritten(capsys):
    from kvlab import check

    check.progress_file().write_text("{half-writ")  # conftest points KVLAB_PROGRESS into a tmp folder
    check.progress()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "progress file" in err[0] and "starting a new one" in err[0]

    def slot_mapping(block_table, block_size, start, end):
        return [block_table[t // block_size] * block_size + t % block_size for t in range(start, end)]

    assert check.slot_mapping(slot_mapping)  # passing an exercise writes a new file
    assert json.loads(check.progress_file().read_text())["slot_mapping"]["function"] == "slot_mapping"
    capsys.readouterr()
    assert check.progress()["slot_mapping"] and capsys.readouterr().err == ""  # healed: silent
