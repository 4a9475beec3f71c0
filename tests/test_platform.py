"""The machines learners bring: a python3 that is too old, and no triton (macOS, Windows).

`make` must find a Python >= 3.11 or stop at once with one line saying how to get one; tested with
fake interpreters that answer version questions like Python 3.10 or 3.12 and record anything else,
so nothing is ever installed. Without triton everything but the kernels must run, and every kernel
cell and test must say why it is skipped: simulated with a `triton` package that fails to import,
first on this process's pieces, then on subprocesses (kvlab itself, the kernel tests, notebook 05).
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvlab import capstone, kernels

ROOT = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make")

# ---- make: which Python --------------------------------------------------------------------------------

FAKE = """#!/bin/sh
# stands in for Python {version}: answers version questions as it would, records anything else and fails
case "$1" in
  --version|-V) echo "Python {version}"; exit 0 ;;
  -c) exec "{real}" -c "import sys; sys.version_info = {info!r}; $2" ;;
esac
echo "$0 $*" >> "{log}"
exit 3
"""


def _fake_python(path: Path, version: str, log: Path) -> Path:
    info = (*map(int, version.split(".")), "final", 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE.format(version=version, real=sys.executable, info=info, log=log))
    path.chmod(0o755)
    return path


@pytest.fixture
def project(tmp_path):
    """A copy of the Makefile, pyproject.toml and the lock with no .venv, and a PATH that holds only fake
    interpreters (bin/) and the tools the Makefile calls (tools/): this machine's real python3.11+ stay out."""
    if MAKE is None:
        pytest.skip("no make on this machine")
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("sh", "id"):
        os.symlink(shutil.which(tool), tools / tool)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under `make test`
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{tools}"
    log = tmp_path / "calls.log"

    def make(*args):
        t0 = time.perf_counter()
        out = subprocess.run([MAKE, "--no-print-directory", *args], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=60)
        return out, time.perf_counter() - t0

    return SimpleNamespace(dir=tmp_path, bin=tmp_path / "bin", log=log, make=make)


def test_make_stops_at_once_with_one_line_when_python_is_too_old(project):
    old = _fake_python(project.bin / "python3", "3.10.12", project.log)
    out, seconds = project.make("setup", f"PYTHON={old}")
    assert out.returncode != 0 and seconds < 10
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and out.stdout == "", out.stderr
    line = lines[0]
    for what in ("needs Python >= 3.11", "Python 3.10.12", "python3.13/3.12/3.11", "apt install python3.11",
                 "brew install", "python.org", "conda env create -f environment.yml && conda activate kvlab",
                 "PYTHON=python", "Stop."):
        assert what in line, what
    assert not (project.dir / ".venv").exists() and not project.log.exists()  # nothing was run, nothing made


def test_make_picks_a_newer_python_from_the_path(project):
    old = _fake_python(project.bin / "python3", "3.10.12", project.log)
    _fake_python(project.bin / "python3.12", "3.12.3", project.log)
    out, seconds = project.make("setup", f"PYTHON={old}")
    assert seconds < 10
    assert out.stdout.splitlines()[0] == f"make: {old} is Python 3.10.12, kvlab needs >= 3.11: using python3.12 " \
                                         "(Python 3.12.3)"
    # the recipe ran the fake python3.12 to make the venv; it recorded that and failed, so nothing installed
    assert project.log.read_text().split()[1:] == ["-m", "venv", ".venv"]
    assert project.log.read_text().split()[0].endswith("python3.12")
    assert out.returncode != 0 and not (project.dir / ".venv").exists()


def test_make_uses_python3_when_it_is_new_enough(project):
    _fake_python(project.bin / "python3", "3.13.1", project.log)
    _fake_python(project.bin / "python3.12", "3.12.3", project.log)
    out, _ = project.make("-n", "setup")
    assert out.returncode == 0, out.stderr
    assert "test -x .venv/bin/python || python3 -m venv .venv" in out.stdout.splitlines()
    assert "using" not in out.stdout and not project.log.exists()


def test_make_catches_a_venv_made_by_an_old_python_and_clean_still_works(project):
    _fake_python(project.dir / ".venv" / "bin" / "python", "3.10.12", project.log)
    out, seconds = project.make("test")
    assert out.returncode != 0 and seconds < 10
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and ".venv was made with Python 3.10.12" in lines[0] and "make clean" in lines[0]
    out, _ = project.make("-n", "clean")  # no Python needed to clean
    assert out.returncode == 0 and out.stdout.startswith("rm -rf .venv"), out.stderr


# ---- no triton, in this process ------------------------------------------------------------------------

@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)


def test_marked_cells_print_why_they_are_skipped(no_triton):
    skip = kernels._skip_if_marked
    printed = [f"print({kernels.SKIPPED_CELL!r})\n"]
    assert skip(["# needs triton\n", "out = K.cast_demo(x)\n"]) == printed
    assert skip(["# NBVAL_CHECK_OUTPUT\n", "# needs triton\n", "out = K.cast_demo(x)\n"]) == printed
    for cell in (["x = 1\n", "# needs triton\n"], ["# NBVAL_CHECK_OUTPUT\n", "x = 1\n"], []):
        assert skip(cell) == cell  # unmarked: unchanged
    assert "Linux" in kernels.SKIPPED_CELL and "container" in kernels.SKIPPED_CELL


def test_cells_that_count_through_the_interpreter_are_skipped_where_kernels_run_compiled(monkeypatch):
    skip = kernels._skip_if_marked
    cell = ["# needs triton's interpreter\n", "# NBVAL_CHECK_OUTPUT\n", "with count_traffic() as n:\n", "    pass\n"]
    monkeypatch.setattr(kernels, "triton_mode", lambda: "interpreter")
    if kernels.available():
        assert skip(cell) == cell  # the interpreter counts: the cell runs
    monkeypatch.setattr(kernels, "triton_mode", lambda: "compiled")
    printed = [f"print({kernels.SKIPPED_CELL if not kernels.available() else kernels.SKIPPED_COMPILED!r})\n"]
    assert skip(cell) == printed
    assert skip(["# needs triton\n", "out = K.cast_demo(x)\n"]) == (
        ["# needs triton\n", "out = K.cast_demo(x)\n"] if kernels.available() else [f"print({kernels.SKIPPED_CELL!r})\n"])
    shell = SimpleNamespace(input_transformers_cleanup=[])
    assert kernels.skip_cells_without_triton(shell)  # compiled kernels: the skipper is on for the counting cells


@pytest.mark.parametrize("book", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_cells_that_count_bytes_say_they_need_the_interpreter(book):
    """count_traffic() raises where the kernels run compiled: a cell that calls it carries the interpreter
    marker (it prints why it is skipped on a GPU instead of failing)."""
    for cell in json.loads(book.read_text())["cells"]:
        code = "".join(cell["source"])
        if cell["cell_type"] == "code" and "count_traffic()" in code:
            assert code.startswith(kernels.INTERPRETER_MARKER), f"{book.name}: mark this cell:\n{code[:300]}"


def test_setup_installs_the_cell_skipper_only_without_triton(monkeypatch):
    shell = SimpleNamespace(input_transformers_cleanup=[])
    if kernels.available():
        assert not kernels.skip_cells_without_triton(shell) and shell.input_transformers_cleanup == []
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert kernels.skip_cells_without_triton(shell) and kernels.skip_cells_without_triton(shell)
    assert shell.input_transformers_cleanup == [kernels._skip_if_marked]  # once, however often setup runs
    assert not kernels.skip_cells_without_triton()  # not in IPython: nothing to do


def test_engine_refuses_the_triton_backend_saying_why(tiny, no_triton):
    from kvlab.engine import LLM

    model, tok = tiny
    with pytest.raises(ValueError, match=r"attn_backend='triton' cannot run here: the Triton kernels need triton, "
                                         r"which installs on Linux only.*one of \('reference', 'torch'\)"):
        LLM(model, tok, num_blocks=8, block_size=4, attn_backend="triton")


def test_capstone_skips_the_triton_configuration_saying_why(no_triton):
    assert capstone.skip_reason("paged INT8 + Triton") == kernels.WHY_NO_TRITON
    assert [n for n in capstone.CONFIGS if capstone.skip_reason(n) is None] == list(capstone.CONFIGS[:3])
    with pytest.raises(ValueError, match="config must be one of"):
        capstone.skip_reason("paged INT3")


def test_bench_kernels_without_triton_prints_the_projection_and_why(no_triton, capsys):
    from kvlab.cli import main

    assert main(["bench", "kernels", "--batches", "1", "--contexts", "1024", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["mode"] == "no triton" and res["checks"] == [] and "Linux only" in res["skipped"]
    assert res["projection"]["rows"] and "measured" not in res
    assert main(["bench", "kernels", "--shapes", "smollm2-135m", "--batches", "4", "--contexts", "256"]) == 0
    out = capsys.readouterr().out
    assert "correctness sweep skipped: the Triton kernels need triton" in out and "PROJECTION" in out


# ---- no triton, for real: a `triton` that fails to import, in subprocesses ----------------------------

@pytest.fixture(scope="module")
def without_triton(tmp_path_factory):
    """Environment for a subprocess in which `import triton` fails, as on a Mac."""
    fake = tmp_path_factory.mktemp("no_triton")
    (fake / "triton").mkdir()
    (fake / "triton" / "__init__.py").write_text('raise ImportError("simulated: no triton on this machine")\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")}
    env["PYTHONPATH"] = os.pathsep.join([str(fake), *filter(None, [env.get("PYTHONPATH")])])
    env["COLUMNS"] = "400"  # pytest -rs lines whole
    return env


KVLAB_WITHOUT_TRITON = """
import json, subprocess, sys
import kvlab
from kvlab import kernels
assert not kernels.available()
info = kvlab.setup(quiet=True)
assert not info.triton_available and info.triton == "not available"
assert "no triton: kernel cells skipped" in info.line(), info.line()
out = subprocess.run([sys.executable, "-m", "kvlab", "info", "--json"], capture_output=True, text=True)
assert out.returncode == 0 and json.loads(out.stdout)["triton_available"] is False, out.stderr
try:
    kernels.paged_decode
    raise AssertionError("the kernels imported without triton")
except ImportError as e:
    assert "kvlab.kernels.decode: the Triton kernels need triton" in str(e), e
from kvlab.engine import LLM, SamplingParams
model, tok = kvlab.load_model("tiny")
llm = LLM(model, tok, num_blocks=16, block_size=4, attn_backend="torch")
assert len(llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
try:
    LLM(model, tok, num_blocks=16, block_size=4, attn_backend="triton")
    raise AssertionError("attn_backend='triton' ran without triton")
except ValueError as e:
    assert "attn_backend='triton' cannot run here" in str(e), e
from kvlab import claims, capstone
from kvlab.viz.bandwidth import bandwidth_widget
from kvlab.bench.kernels import recorded_h200
bandwidth_widget("llama-3-8b", batch=32, context=16384, gpu="H200", bench=recorded_h200())
rows = claims.run(ids=["int8-39pct", "unfused"])  # the two claims of notebook 05: recorded run + byte model
assert [r["id"] for r in rows] == ["int8-39pct", "unfused"]
assert capstone.skip_reason("paged INT8 + Triton") == kernels.WHY_NO_TRITON
print("kvlab without triton: ok")
"""


def test_everything_but_the_kernels_runs_without_triton(without_triton):
    out = subprocess.run([sys.executable, "-c", KVLAB_WITHOUT_TRITON], env=without_triton, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("kvlab without triton: ok")


def test_kernel_tests_are_skipped_saying_why_without_triton(without_triton):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/test_05_kernels.py", "tests/test_check.py::test_online_softmax_update",
                          "tests/test_04_engine.py::test_eos_and_stop_ids_finish_requests_early"],
                         env=without_triton, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = out.stdout.strip().splitlines()[-1]
    assert "2 passed" in summary and "failed" not in summary and "error" not in summary, out.stdout
    skipped = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all(kernels.WHY_NO_TRITON in line for line in skipped), out.stdout
    assert any("test_05_kernels.py" in line for line in skipped) and any("test_check.py" in line for line in skipped)


def test_notebook_05_runs_without_triton_its_kernel_cells_saying_why(without_triton, tmp_path):
    # nbval runs every cell: the marked ones print the skip line, the byte model and the H200 run still work
    book = ROOT / "notebooks" / "05_fused_triton_kernel.ipynb"
    cells = [c for c in json.loads(book.read_text())["cells"] if c["cell_type"] == "code"]
    marked = sum("".join(c["source"]).startswith(kernels.CELL_MARKER) for c in cells)
    assert 10 <= marked <= len(cells) - 4  # unmarked: set-up, the byte model, the H200 widget and table
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                          "--nbval-current-env", str(book)], env={**without_triton, "KVLAB_PROGRESS":
                                                                  str(tmp_path / "progress.json")},
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "failed" not in out.stdout.strip().splitlines()[-1], out.stdout[-3000:]


# ---- every cell that needs triton says so ---------------------------------------------------------------

NEEDS_TRITON = ("TRITON.write(", "TRITON.decode(", "K.paged_decode", "K.cast_demo", "count_traffic()", "skeleton_decode(",
                "check.block_walk", "check.dequant_int8",
                "count_step_bytes", "import triton", "online_softmax_update", 'attn_backend="triton"', '"triton")',
                "'triton',")


@pytest.mark.parametrize("book", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_cells_that_run_the_kernels_are_marked(book):
    """A cell that calls a kernel (or names the triton backend) carries `# needs triton` (a cell that only
    uses a marked cell's results must carry it too: the run above without triton checks those)."""
    for cell in json.loads(book.read_text())["cells"]:
        code = "".join(cell["source"])
        if cell["cell_type"] == "code" and any(name in code for name in NEEDS_TRITON):
            assert code.startswith(kernels.CELL_MARKER), f"{book.name}: mark this cell:\n{code[:300]}"


def test_setup_hands_freed_memory_back_after_every_cell_on_linux_only(monkeypatch):
    """kvlab.setup() registers one post-cell hook that calls glibc's malloc_trim; elsewhere, nothing."""
    from kvlab import env

    class Events:
        def __init__(self):
            self.callbacks = {"post_run_cell": []}

        def register(self, name, fn):
            self.callbacks[name].append(fn)

    shell = SimpleNamespace(events=Events())
    if not sys.platform.startswith("linux"):
        assert env.return_memory_after_cells(shell) is False
        return
    trimmed = []
    monkeypatch.setattr(env, "_glibc_trim", lambda: (lambda pad: trimmed.append(pad)))
    assert env.return_memory_after_cells(shell) and env.return_memory_after_cells(shell)
    assert shell.events.callbacks["post_run_cell"] == [env._trim_after_cell]  # once, however often setup runs
    shell.events.callbacks["post_run_cell"][0](None)
    assert trimmed == [0]
    monkeypatch.undo()
    assert env._glibc_trim() is not None  # the real glibc on this Linux
    monkeypatch.setattr(env.sys, "platform", "darwin")
    assert env._glibc_trim() is None and env.return_memory_after_cells(SimpleNamespace(events=Events())) is False
