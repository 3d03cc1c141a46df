# Everything a fresh machine needs: `make demo` (install + the main job), `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast policy clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned (torch==2.13.0, CPU build); see ../shared/ENV.md
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# The main job: local Ray cluster, tiny policy (built and cached on first run), synthetic task.
demo: install
	$(VENV)/bin/streamrl train configs/tiny.yaml

policy: install
	$(VENV)/bin/streamrl make-policy configs/tiny.yaml

test: install
	$(VENV)/bin/pytest -q

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs .cache
