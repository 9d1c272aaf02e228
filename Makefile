# The two commands a user needs: `make run` (the whole stack) and `make test` (the suite).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install run test lint chaos bench clean

$(BIN)/.installed: pyproject.toml requirements.lock requirements-dev.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.lock -r requirements-dev.lock
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

install: $(BIN)/.installed

## run: start NATS, Postgres and the four services (or use NATS_URL / DATABASE_URL); Ctrl-C stops all
run: install
	$(BIN)/python -m deploy.stack

## test: lint, then the whole suite against real nats-server and PostgreSQL processes
test: install lint
	$(BIN)/pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## chaos: long fault-injection soaks (SEED=, DURATION=)
chaos: install
	$(BIN)/pytest -m chaos -p no:cacheprovider

## bench: benchmarks; they print ratios against a baseline measured in the same run
bench: install
	$(BIN)/pytest -m bench -s -p no:cacheprovider

clean:
	rm -rf $(VENV) .rackplane .pytest_cache .ruff_cache
