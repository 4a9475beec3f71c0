import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import kvlab

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import notebook_costs  # noqa: E402  (tools/: the same table `tools/notebook_costs.py` prints)


def pytest_configure(config):
    """Registers :class:`_KernelMemory`. Under ``pytest -n N`` (``make test`` runs two workers) each
    worker, and the Jupyter kernels and subprocesses it starts, gets its share of the cores: two workers
    on two cores run one thread each instead of fighting over both. An explicit ``OMP_NUM_THREADS`` is kept."""
    config.pluginmanager.register(_KernelMemory(), "kvlab-kernel-memory")
    workers = getattr(config, "workerinput", {}).get("workercount")
    if not workers:
        return
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    torch.set_num_threads(int(threads))  # this process imported torch before the variable was set


def _notebook_of(nodeid: str) -> str | None:
    """The notebook a test runs: an nbval cell's, or the browser pass's (tests/test_browser.py)."""
    path, _, name = nodeid.partition("::")
    if path.endswith(".ipynb"):
        return path.rsplit("/", 1)[-1].removesuffix(".ipynb")
    browser = re.fullmatch(r"test_notebook_widgets_render_and_react\[(.+)\]", name)
    return browser[1] if browser and path.endswith("test_browser.py") else None


def _longest_first(item) -> tuple:
    """The notebooks first, 06 (the longest) to 00, each its browser pass then its nbval cells; then
    every other test in its usual order: with two workers the long runs must not come last."""
    notebook = _notebook_of(item.nodeid)
    if notebook is None:
        return (1,)
    return (0, -int(re.match(r"\d+", notebook)[0]), item.path.suffix == ".ipynb")


#: modules whose tests share a module fixture that costs seconds (notebook 06's capstone served by kvlab's engine)
SHARED_SETUP = ("tests/test_yours.py",)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist it is never called
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n N`` (``make test``): a notebook's nbval cells run in order in one kernel, so they
    go to one worker together, with the notebook's browser pass (a notebook's two runs never overlap:
    notebook 04 alone peaks at about 11 GB). Every other test is handed out on its own, in the order
    the workers collected (:func:`pytest_collection_modifyitems`), not xdist's order by group size."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling  # why: pytest-xdist is only there to run in parallel

    class NotebookScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            notebook = _notebook_of(nodeid)
            module = nodeid.partition("::")[0]
            if module in SHARED_SETUP:  # one worker builds the module's costly fixture once
                return module
            return f"notebook {notebook}" if notebook else nodeid

    config.option.loadscopereorder = False
    return NotebookScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``triton`` run the kernels: where triton is missing (macOS, Windows) they are skipped,
    each saying why and where they run (``pytest -rs`` lists them). Under xdist the longest runs
    (the notebooks) come first, so that no worker starts one when the other is nearly done."""
    from kvlab import kernels

    if hasattr(config, "workerinput"):
        items.sort(key=_longest_first)  # stable: cells and tests keep their order
    if kernels.available():
        return
    skip = pytest.mark.skip(reason=kernels.WHY_NO_TRITON)
    for item in items:
        if item.get_closest_marker("triton"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny():
    model, tok = kvlab.load_model("tiny")
    return model, tok


@pytest.fixture(scope="session")
def smollm2():
    model, tok = kvlab.load_model("smollm2-135m")
    return model, tok


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    """Checkers record passed exercises and keep the parts; tests must never write into the learner's own
    progress file or kept parts (kept beside the progress file unless $KVLAB_KEPT says otherwise)."""
    monkeypatch.setenv("KVLAB_PROGRESS", str(tmp_path / "progress.json"))
    monkeypatch.delenv("KVLAB_KEPT", raising=False)


class _KernelMemory:
    """Each nbval cell's peak memory: the resident set of the notebook's kernel and its children, sampled
    every 0.2 s; with the cell's duration it makes the per-notebook table at the end of ``make test``.
    A plugin, not a conftest hook: a conftest's hooks see only the tests under its own folder, and the
    notebooks are not under tests/."""

    sampler = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        if item.path.suffix != ".ipynb":
            yield
            return
        try:  # nbval's kernel for this notebook (started in its file's setup)
            pid = item.parent.kernel.km.provisioner.process.pid
        except AttributeError:
            pid = None
        if self.sampler is None or self.sampler.proc.pid != pid:
            if self.sampler is not None:
                self.sampler.stop()
            self.sampler = notebook_costs.TreePeak(pid).start() if pid is not None else None
        if self.sampler is not None:
            self.sampler.reset()  # this cell's peak starts here
        yield
        peak = self.sampler.reset() if self.sampler is not None else 0
        private = self.sampler.last_private if self.sampler is not None else 0
        item.user_properties.append(("nbcell", [item.path.stem, item.cell_num, peak, private]))


def _notebook_table(terminalreporter) -> list[str]:
    """nbval's run per notebook: its cells' summed wall time, five slowest cells, peak memory."""
    rows: dict[str, dict] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            for name, value in getattr(r, "user_properties", ()):
                if name == "nbcell" and r.when == "call":
                    nb, code_num, peak, private = value
                    path = Path(str(r.fspath))
                    row = rows.setdefault(nb, dict(notebook=nb, wall_s=0.0, peak_bytes=0, peak_cell=-1, cells=[],
                                                   path=path, private_bytes=0))
                    row["wall_s"] += r.duration
                    row["private_bytes"] = max(row["private_bytes"], private)
                    if peak > row["peak_bytes"]:
                        row["peak_bytes"], row["peak_cell"] = peak, code_num
                    row["cells"].append((code_num, r.duration))
    for row in rows.values():  # nbval counts code cells; the table names a cell by its index among all cells
        cells = json.loads(row["path"].read_text())["cells"] if row["path"].is_file() else []
        index = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
        row["cells"] = [(index[n] if n < len(index) else n, s) for n, s in row["cells"]]
        if 0 <= row["peak_cell"] < len(index):
            row["peak_cell"] = index[row["peak_cell"]]
    return notebook_costs.table([rows[k] for k in sorted(rows)]) if rows else []


def pytest_terminal_summary(terminalreporter):
    """The notebooks' costs under nbval, and the browser runs' timings (tests/test_browser.py), also when
    xdist workers ran them."""
    table = _notebook_table(terminalreporter)
    if table:
        terminalreporter.section("notebooks under nbval: cells summed, beside the other tests (alone: tools/notebook_costs.py)")
        for line in table:
            terminalreporter.write_line(line)
    lines = [value for reports in terminalreporter.stats.values() for r in reports if getattr(r, "when", "") == "call"
             for name, value in r.user_properties if name == "browser"]
    if lines:
        terminalreporter.section("browser runs")
        for line in sorted(lines):
            terminalreporter.write_line(line)
