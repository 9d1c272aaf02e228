# The two commands a user needs: `make run` (the whole stack) and `make test` (the suite).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install run test test-containers test-ha lint chaos fuzz bench schemas clean

$(BIN)/.installed: pyproject.toml requirements.lock requirements-dev.lock
	@$(PYTHON) deploy/preflight.py install
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.lock -r requirements-dev.lock
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

install: $(BIN)/.installed

## run: start NATS, Postgres and the four services (or use NATS_URL / DATABASE_URL); Ctrl-C stops all.
## FAULTS=1 lets the services take fault injection (rackctl chaos); TLS=1 puts NATS behind TLS; HA=1 runs
## a three-node NATS cluster (every stream at three replicas), PostgreSQL under Patroni (a primary and a
## synchronous standby, etcd) and two processes of each service.
run: install
	@$(PYTHON) deploy/preflight.py run
	@if [ -n "$(HA)" ] && [ "$(HA)" != 0 ]; then $(PYTHON) deploy/preflight.py ha; fi
	RACKPLANE_FAULTS=$(FAULTS) RACKPLANE_TLS=$(TLS) RACKPLANE_HA=$(HA) $(BIN)/python -m deploy.stack

## test: lint, then the whole suite against real nats-server and PostgreSQL processes. Tests run on
## TEST_WORKERS workers (one more than this machine's 2 cores: a worker often waits on its stack; 2 took
## 412 s, 3 took 357 s, 6 took 574 s), each with stacks of its own; the suite starts some 300 Python
## processes, so the project is byte-compiled first (whatever PYTHONDONTWRITEBYTECODE says).
TEST_WORKERS ?= 3
test: install lint
	@$(PYTHON) deploy/preflight.py test
	$(BIN)/python -m compileall -q -j 0 shared services rackctl deploy
	$(BIN)/pytest -n $(TEST_WORKERS) --dist worksteal

## test-containers: the images built here (a Debian base made by debootstrap, no registry needed), then
## tests with PostgreSQL and nats-server in containers (testcontainers), the whole docker-compose.yml
## walked through as the README walks `make run`, and docker-compose.ha.yml the same, losing a broker node
## and the database primary. Needs root for Docker: it installs Debian's docker.io,
## docker-compose and debootstrap and starts dockerd when they are missing (deploy/containers.sh).
test-containers: install
	deploy/containers.sh engine
	deploy/containers.sh images
	$(BIN)/pytest -n 0 -m containers -p no:cacheprovider -o timeout=600 tests/containers

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## test-ha: the stack of `make run HA=1` losing one machine at a time while commands run (tests/ha, the
## `ha` marker; `make test` leaves them out): every acknowledged command has its effect, the checker finds
## nothing; each kind of loss measured HA_KILLS times (2 here; docs/reliability.md's figures take 5)
HA_KILLS ?= 2
test-ha: install
	@$(PYTHON) deploy/preflight.py ha
	HA_KILLS=$(HA_KILLS) $(BIN)/pytest -n 0 -m ha -s -p no:cacheprovider -o timeout=900 tests/ha

## chaos: a long fault-injection soak: random commands under random faults, then every invariant checked
## (make chaos SEED=42 DURATION=600; a failing run prints its seed and the log that replays it)
chaos: install
	SEED=$(SEED) DURATION=$(DURATION) RACKPLANE_HA=$(HA) $(BIN)/pytest -n 0 -m chaos -s -p no:cacheprovider -o timeout=0 tests/chaos

## fuzz: the fuzz suite at full size: 10,000 hostile messages (make fuzz FUZZ_MESSAGES=... FUZZ_SEED=...);
## `make test` runs it with a few hundred, and CI (.ci/run) at full size after it, bounded in time
fuzz: install
	FUZZ_MESSAGES=$(or $(FUZZ_MESSAGES),10000) FUZZ_SEED=$(FUZZ_SEED) $(BIN)/pytest -n 0 -s -p no:cacheprovider -o timeout=0 tests/fuzz

## schemas: write the contract as data from the code: docs/schemas/*.json (JSON Schema per message schema
## and version, and a kept example of each) and docs/asyncapi.yaml (AsyncAPI 3.0); commit what it writes
schemas: install
	$(BIN)/python -m deploy.schemas

## bench: benchmarks; they print ratios against a baseline measured in the same run
bench: install
	$(BIN)/pytest -n 0 -m bench -s -p no:cacheprovider -o timeout=0

clean:
	rm -rf $(VENV) .rackplane .pytest_cache .ruff_cache
