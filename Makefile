# One-command entry points. The venv pins torch==2.13.0 (constraints.txt) because on these
# machines an unpinned torch resolves to a multi-GB CUDA build; Kiln itself supports 2.11-2.14.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= constraints.txt
RECIPE ?= recipes/data-demo.toml

.PHONY: setup demo lint test test-slow bench clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
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
