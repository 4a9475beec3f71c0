import pytest

import kvlab


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
