import os
import re

import pytest
import torch

import kvlab


def pytest_configure(config):
    """Under ``pytest -n N`` (``make test`` runs two workers) each worker, and the Jupyter kernels
    and subprocesses it starts, gets its share of the cores: two workers on two cores run one thread
    each instead of fighting over both. An explicit ``OMP_NUM_THREADS`` is kept."""
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
    """Checkers record passed exercises; tests must never write into the learner's own progress file."""
    monkeypatch.setenv("KVLAB_PROGRESS", str(tmp_path / "progress.json"))


def pytest_terminal_summary(terminalreporter):
    """The browser runs' timings (tests/test_browser.py), also when xdist workers ran them."""
    lines = [value for reports in terminalreporter.stats.values() for r in reports if getattr(r, "when", "") == "call"
             for name, value in r.user_properties if name == "browser"]
    if lines:
        terminalreporter.section("browser runs")
        for line in sorted(lines):
            terminalreporter.write_line(line)
