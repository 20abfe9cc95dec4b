# Two entry points: `make train` (the default job) and `make test` (the whole suite); `make test-torch`
# runs the suite under another torch of the supported range (below).
# Each creates .venv on first use. torch is installed first at exactly 2.13.0 (the CPU build on disk
# here); installing the project before it would pull the newest CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test test-torch lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# lint first, so CI (which runs `make test`) keeps ruff and mypy clean; about 20 s
test: lint
	$(PY) -m pytest $(ARGS)

# `make test-torch TORCH=2.15.0`: the suite under another torch, in its own .venv-torch<version>, installed
# from the package index (a CUDA build there; it runs on CPU). PIP_CONSTRAINT=/dev/null lifts a machine-wide
# pip constraint file (one here caps torch) for this environment only; an empty PIP_CONSTRAINT would not.
TORCH ?= 2.15.0
TVENV := .venv-torch$(TORCH)
TPIP := PIP_CONSTRAINT=/dev/null $(TVENV)/bin/python -m pip install --quiet

$(TVENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(TVENV)
	$(TPIP) --upgrade pip
	$(TPIP) torch==$(TORCH)
	$(TPIP) -e '.[dev]' torch==$(TORCH)
	touch $@

test-torch: $(TVENV)/.installed
	$(TVENV)/bin/python -m pytest $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_parallel tests train.py config_checks.py plan.py benchmarks
	$(VENV)/bin/mypy lightning_parallel

clean:
	rm -rf $(VENV) .venv-torch* outputs multirun
