# Two entry points: `make train` (the default job) and `make test` (the whole suite).
# Each creates .venv on first use. torch is installed first at exactly 2.13.0 (the CPU build on disk
# here); installing the project before it would pull the newest CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_parallel tests train.py config_checks.py plan.py benchmarks
	$(VENV)/bin/mypy lightning_parallel

clean:
	rm -rf $(VENV) outputs multirun
