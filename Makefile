# One-command entry points. The venv pins torch==2.13.0 (constraints.txt) because on these
# machines an unpinned torch resolves to a multi-GB CUDA build; Kiln itself supports 2.11-2.14.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= constraints.txt
RECIPE ?= recipes/data-demo.toml

.PHONY: setup demo lint test test-slow bench clean

# pip shows its progress bar: a first install downloads a few hundred MB and takes minutes.
PIP_INSTALL := $(PY) -m pip install --progress-bar on -c $(CONSTRAINTS)

# make demo: the core and what the demo uses (README, "Install": size and time measured).
# --no-compile: pip's bytecode for every torch module is ~150 MB; Python writes it for the modules
# the demo imports, on first use.
$(VENV)/.demo-installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --no-compile -e '.[demo]'
	touch $@

# make lint / test / test-slow / bench: everything the tests compare against (the test extra).
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[test]'
	touch $@ $(VENV)/.demo-installed

setup: $(VENV)/.installed

demo: $(VENV)/.demo-installed
	$(VENV)/bin/kiln run $(RECIPE)

lint: setup
	$(VENV)/bin/ruff check kiln tests bench
	$(VENV)/bin/ruff format --check kiln tests bench

test: setup
	$(PY) -m pytest -q -m "not slow"

test-slow: setup
	$(PY) -m pytest -q -m slow

bench: setup
	$(PY) bench/train_step.py

clean:
	rm -rf $(VENV) runs .pytest_cache
