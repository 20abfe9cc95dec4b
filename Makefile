# Two entry points: `make train` (the default job) and `make test` (the whole suite); `make test-torch`
# runs the suite under another torch of the supported range (below).
# Each creates .venv on first use. torch is installed first at exactly 2.13.0 (the CPU build on disk
# here); installing the project before it would pull the newest CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test test-torch lint clean gpu-wheels gpu-check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# lint first, so CI (which runs `make test`) keeps ruff and mypy clean; about 20 s
# Two workers, each taking whole test files (--dist loadfile, so a file's module-scoped launch that serves several
# checks runs once): in-process tests run one torch thread (tests/conftest.py), so a second file fills the second core.
test: lint
	$(PY) -m pytest -n 2 --dist loadfile $(ARGS)

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

# The GPU proof (docs/gpus.md). `make gpu-wheels`, where the package index is reachable, puts into .whl/ (ignored)
# the wheels the GPU machine lacks; `make gpu-check` installs them into a folder of its own (no network) and runs
# benchmarks/gpu_check.py; without CUDA it rehearses on CPU at toy sizes. ARGS="--parts multi_rank" runs one part and
# merges it into the results. The GPU machine's image (2026-11) has torch 2.11, Lightning 2.6.6, torchmetrics 1.9.0,
# pytest, rich, scikit-learn, matplotlib, numpy and PyYAML, and no Hydra: hydra-core and omegaconf (universal wheels)
# and their antlr4-python3-runtime 4.9.3 (a source release only: built here into a pure-Python wheel).
HOST_PY := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_SITE ?= /tmp/lightning_parallel_gpu_site

gpu-wheels:
	mkdir -p .whl
	$(HOST_PY) -m pip download --quiet --no-deps --only-binary=:all: -d .whl hydra-core==1.3.2 omegaconf==2.3.0
	$(HOST_PY) -m pip wheel --quiet --no-deps -w .whl antlr4-python3-runtime==4.9.3

gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then \
		$(HOST_PY) -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) .whl/*.whl; fi
	@PYTHONPATH=$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(HOST_PY) benchmarks/gpu_check.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_parallel tests train.py config_checks.py job_output.py plan.py benchmarks
	$(VENV)/bin/mypy lightning_parallel

clean:
	rm -rf $(VENV) .venv-torch* outputs multirun
