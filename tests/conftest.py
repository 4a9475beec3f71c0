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
