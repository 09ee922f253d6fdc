# TRACE developer entry points. `make test` and `make demo` work on a fresh machine with Python 3.12.
SHELL := /bin/bash
export PYENV_VERSION ?= 3.12.1
PYTHON ?= python3.12
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SGLANG_VERSION := 0.5.15.post1
PYTEST_ARGS ?=

.PHONY: setup check-sglang test test-fast test-gpu demo lint clean

setup: $(STAMP)

# The venv is rebuilt when the project metadata changes. SGLang is installed without its dependencies: its GPU
# stack (sglang-kernel, flashinfer) does not install on CPU machines; tests import only its pure-torch modules.
# The editable install registers TRACE's SGLang plugin entry point (sglang.srt.plugins: trace).
# megatron-core is patched so that its optimizers run on CPU parameters (patches/megatron; no change on CUDA).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps sglang==$(SGLANG_VERSION)
	$(PY) -m pip install -q -e '.[sglang-cpu]'
	$(PY) scripts/sglang_patches.py apply
	$(PY) scripts/megatron_patches.py apply
	touch $(STAMP)

# The SGLang side must import and be patched before any test runs: a broken import fails `make test` here instead
# of letting its test modules error or skip (the sgl_kernel stand-in replaces only the compiled kernel package).
check-sglang: $(STAMP)
	$(PY) scripts/sglang_patches.py check
	$(PY) -c "from tests.sglang_cpu import install_sgl_kernel_stand_in as s; s(); \
	import sglang.srt.server_args, sglang.srt.managers.scheduler, sglang_trace.plugin as p, sglang.srt.plugins as sp; \
	sp.load_plugins(); p.check_applied(); print('SGLang', sglang.__version__, 'imports with the TRACE plugin applied')"

# The whole CPU suite (what CI runs), on two pytest-xdist workers (--dist loadgroup, as test-fast).
test: check-sglang
	$(PY) -m pytest -q -m "not gpu" -n 2 --dist loadgroup $(PYTEST_ARGS)

# The CPU tests not marked slow, on two pytest-xdist workers; tests sharing a local Ray instance carry
# xdist_group("ray") and run on one worker (--dist loadgroup).
test-fast: check-sglang
	$(PY) -m pytest -q -m "not slow and not gpu" -n 2 --dist loadgroup $(PYTEST_ARGS)

# On a machine with a CUDA GPU.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

# The RL loop on the embedded default (tiny Qwen3-MoE, CPU): BF16, FP4 + QAT and FP4 + TRACE side by side.
# `make demo RECIPE=mxfp4-w4a4-kv4` runs another precision recipe (docs/design.md), into out/rl-<recipe>.
demo: $(STAMP)
	TRACE_RL=$(VENV)/bin/trace-rl RECIPE=$(RECIPE) scripts/launch_disagg.sh

# ruff (stale `noqa` comments included: RUF100) and mypy over the packages of [tool.mypy] in pyproject.toml.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis

# Container image (docker/Dockerfile, docs/deploy.md), tagged $(IMAGE):<project version>. `docker` needs a Docker
# engine and runs the static checks first; `docker-check` needs none (CI): static checks, then the Dockerfile's patch
# step on the pinned sglang and megatron-core wheels.
IMAGE ?= trace-rl
IMAGE_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
.PHONY: docker docker-check

docker:
	python3 scripts/check_dockerfile.py --static-only
	docker build -f docker/Dockerfile -t $(IMAGE):$(IMAGE_VERSION) .

docker-check: $(STAMP)
	$(PY) scripts/check_dockerfile.py
