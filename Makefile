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

## run: start NATS, Postgres and the four services (or use NATS_URL / DATABASE_URL); Ctrl-C stops all.
## FAULTS=1 lets the services take fault injection (rackctl chaos); TLS=1 puts NATS behind TLS.
run: install
	RACKPLANE_FAULTS=$(FAULTS) RACKPLANE_TLS=$(TLS) $(BIN)/python -m deploy.stack

## test: lint, then the whole suite against real nats-server and PostgreSQL processes. Tests run on up to
## 4 workers (one per core), each with stacks of its own; the suite starts some 300 Python processes, so
## the project is byte-compiled first (whatever PYTHONDONTWRITEBYTECODE says).
test: install lint
	$(BIN)/python -m compileall -q -j 0 shared services rackctl deploy
	$(BIN)/pytest -n auto --maxprocesses 4 --dist worksteal

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## chaos: a long fault-injection soak: random commands under random faults, then every invariant checked
## (make chaos SEED=42 DURATION=600; a failing run prints its seed and the log that replays it)
chaos: install
	SEED=$(SEED) DURATION=$(DURATION) $(BIN)/pytest -n 0 -m chaos -s -p no:cacheprovider -o timeout=0 tests/chaos

## bench: benchmarks; they print ratios against a baseline measured in the same run
bench: install
	$(BIN)/pytest -n 0 -m bench -s -p no:cacheprovider -o timeout=0

clean:
	rm -rf $(VENV) .rackplane .pytest_cache .ruff_cache
