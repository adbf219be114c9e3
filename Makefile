# Developer commands. `make run` and `make test` work on a fresh Debian machine with Python 3.11:
# the broker is $CLOCKWORK_BROKER_URL, else the local one on 127.0.0.1:5672, else a private
# rabbitmq-server node (tests/infra/rabbit_node.py) that is stopped again when the target ends.

PY ?= $(shell command -v python3.11 2>/dev/null || command -v python3 2>/dev/null)
VENV := .venv
BIN := $(VENV)/bin
STATE := .broker
BROKER := $(BIN)/python -m tests.infra.rabbit_node
# e.g. `make test BROKER_FLAGS=--force-private`: a private node even when 5672 answers.
BROKER_FLAGS ?=

# Shell prologue for targets that need a broker: sets $$url and, on any exit of the recipe's shell
# (failure and Ctrl-C included), releases a private node, which stops once no other `make` uses
# it ($$$$, the shell's PID, is the owner). A no-op for a broker we did not start.
WITH_BROKER := trap '$(BROKER) stop --state-dir $(STATE) --owner $$$$' EXIT; trap 'exit 130' INT TERM; \
	url=$$($(BROKER) ensure --state-dir $(STATE) --owner $$$$ $(BROKER_FLAGS)) || exit $$?

.PHONY: run test worker bench reliability chaos lint typecheck chromium dist clean

# File targets, so the environment is built once and reinstalled only when pyproject.toml changes.
# pip (not python) marks a usable venv: without python3-venv, `venv` leaves a python but no pip.
$(BIN)/pip:
	@test -n "$(PY)" || { echo "Python 3.11 is needed (python3.11 or python3 on PATH)." >&2; exit 1; }
	$(PY) -m venv $(VENV) || { echo "Creating the venv failed; on Debian: apt-get install python3-venv" >&2; exit 1; }

# Running (make run, make worker) needs the runtime only; testing adds the test and dev extras.
$(VENV)/.runtime: $(BIN)/pip pyproject.toml
	$(BIN)/pip install -e .
	touch $@

$(VENV)/.installed: $(VENV)/.runtime pyproject.toml
	$(BIN)/pip install -e '.[test,dev]'
	touch $@

# Debian's chromium, for the Flower screenshot test (tests/interop/browser.py fails without it, never
# skips). Phony, so a chromium removed since the last run is noticed; a no-op once it is on PATH.
chromium:
	@command -v chromium >/dev/null 2>&1 && exit 0; \
	if [ "$$(id -u)" = 0 ]; then sudo=; \
	elif command -v sudo >/dev/null 2>&1; then sudo=sudo; \
	else echo "chromium is missing and this is not root without sudo: run 'apt-get install -y chromium' as root." >&2; exit 1; fi; \
	$$sudo apt-get update && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium \
		|| { echo "Installing chromium failed; the Flower screenshot test needs Debian's chromium." >&2; exit 1; }; \
	command -v chromium >/dev/null 2>&1 || { echo "chromium is still not on PATH after installing it." >&2; exit 1; }

run: $(VENV)/.runtime
	@$(WITH_BROKER); CLOCKWORK_BROKER_URL="$$url" $(BIN)/python -m examples.demo

# The suite in TEST_WORKERS pytest processes (pytest-xdist), a test file to each at a time, so a
# module's shared worker stays one; each process makes its own vhost. TEST_WORKERS=0: one process.
# The 3-node cluster tests (marked alone) run after them, in one process: beside other tests, or a
# second cluster, the nodes starve on 2 cores and a healed partition may not rejoin in time.
TEST_WORKERS ?= 2
test: lint typecheck chromium
	@$(WITH_BROKER); AMQP_URL="$$url" $(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile -m "not chaos and not alone" \
		&& AMQP_URL="$$url" $(BIN)/pytest -m "alone and not chaos"

worker: $(VENV)/.runtime
	@$(WITH_BROKER); CLOCKWORK_BROKER_URL="$$url" $(BIN)/python -m worker -A examples.tasks:app -l info

# Us beside Celery and Dramatiq (installed into .bench-peers/ on first use) and the raw AMQP
# libraries, alternating, 3 rounds (~12 min on 2 cores).
# Smoke run (~2 min): make bench BENCH_FLAGS="--rounds 1 --quick"
BENCH_FLAGS ?=
bench: $(VENV)/.installed
	@$(WITH_BROKER); CLOCKWORK_BROKER_URL="$$url" $(BIN)/python -m bench.compare $(BENCH_FLAGS)

# The fault-injection matrix (tests/reliability: private nodes and a 3-node cluster, never the shared
# broker), then its figures into RELIABILITY.md. `make test` runs it too, at the CI size (N = 1,000);
# `make chaos` runs the nightly size (N = 10,000) and the larger rows.
reliability: $(VENV)/.installed
	@$(WITH_BROKER); AMQP_URL="$$url" $(BIN)/pytest tests/reliability; status=$$?; \
	$(BIN)/python -m tests.reliability.summary; exit $$status

chaos: $(VENV)/.installed
	@$(WITH_BROKER); AMQP_URL="$$url" $(BIN)/pytest -m chaos tests/reliability; status=$$?; \
	$(BIN)/python -m tests.reliability.summary; exit $$status

# The wheel (dist/clockwork_tasks-<version>-py3-none-any.whl): the three packages, their py.typed
# and the console scripts, no tests (README, "Install"). pip builds it in an isolated environment
# with pyproject's build requirements and installs nothing into the venv. build/ goes first: a
# stale one from an earlier build would carry deleted modules into the wheel.
dist: $(BIN)/pip
	rm -rf build dist *.egg-info
	$(BIN)/pip wheel --no-deps --wheel-dir dist .
	rm -rf build *.egg-info

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed
	$(BIN)/mypy

clean:
	@if [ -x $(BIN)/python ] && [ -d $(STATE) ]; then $(BROKER) stop --state-dir $(STATE); fi
	rm -rf $(VENV) $(STATE) .mypy_cache .ruff_cache .pytest_cache .hypothesis *.egg-info build dist
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
