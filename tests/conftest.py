import pytest

import kvlab


def pytest_collection_modifyitems(config, items):
    """Tests marked ``triton`` run the kernels: where triton is missing (macOS, Windows) they are skipped,
    each saying why and where they run (``pytest -rs`` lists them)."""
    from kvlab import kernels

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
