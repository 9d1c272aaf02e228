"""Settings from the environment, the same names for every service, in one class (the kinds of value
they take are in shared/config_values.py).

`Settings` lists every variable a service process reads, with its default and what it means; a value it
cannot have stops the process with one line naming the variable and what it expects (`ConfigError`).
`python -m shared.config` prints them as the table in docs/architecture.md (tests/test_config.py keeps the
two equal).
"""

from __future__ import annotations

import os
import sys
from functools import cache
from pathlib import Path
from typing import Literal

from pydantic import model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# `X as X`: names kept here for the modules that import them from shared.config
from shared.config_rackctl import RackctlSettings as RackctlSettings
from shared.config_rackctl import dead_letter_alert as dead_letter_alert
from shared.config_values import ConfigError as ConfigError
from shared.config_values import (
    CrashPoints,
    Delay,
    Duration,
    Flag,
    LogFormat,
    LogLevel,
    Port,
    Shapes,
    Traces,
    markdown_table,
    read,
    setting,
)
from shared.config_values import parse_duration as parse_duration

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5433/rackplane"
DB_LOGINS = Path("secrets") / "db"
"""Under a stack's folder: one `<role>.url` file (mode 0600) per database login (deploy/dbroles.py)."""


def rackplane_home() -> Path:
    """Where `make run` keeps its state, logs and credentials."""
    return Path(os.environ.get("RACKPLANE_HOME") or Path(__file__).resolve().parent.parent / ".rackplane")


def check_database_url() -> str:
    """The database for `rackctl check`: $DATABASE_URL, else the read-only login `make run` wrote."""
    if url := os.environ.get("DATABASE_URL"):
        return url
    path = rackplane_home() / DB_LOGINS / "check.url"
    return path.read_text().strip() if path.exists() else DEFAULT_DATABASE_URL


class Settings(BaseSettings):
    """Every setting of a service process, read from its environment (an empty value counts as unset)."""

    model_config = SettingsConfigDict(env_ignore_empty=True, extra="ignore", populate_by_name=True)

    # connections
    nats_url: str = setting(
        "NATS_URL",
        DEFAULT_NATS_URL,
        "the broker (`tls://...` with TLS); a cluster's nodes comma-separated (`make run HA=1`)",
    )
    nats_nkey_file: str | None = setting(
        "NATS_NKEY_FILE", None, "the process's own NATS credential, an nkey seed file (docs/security.md)"
    )
    nats_ca_file: str | None = setting(
        "NATS_CA_FILE", None, "the CA of the broker's certificate: the connection then uses TLS"
    )
    database_url: str = setting(
        "DATABASE_URL",
        DEFAULT_DATABASE_URL,
        "the database, as the service's own login role (each service uses its own schema; see "
        "[security.md](security.md#database-roles))",
    )
    database_url_file: Path | None = setting(
        "DATABASE_URL_FILE",
        None,
        "a file holding the database URL, read when `DATABASE_URL` is unset (docker-compose.yml)",
    )
    log_level: LogLevel = setting("RACKPLANE_LOG", "INFO", "log level")
    traces: Traces = setting(
        "RACKPLANE_TRACES",
        "none",
        "`console`, `otlp` (standard `OTEL_EXPORTER_OTLP_*` settings), `file:PATH` (JSON lines)",
    )
    log_format: LogFormat = setting(
        "RACKPLANE_LOG_FORMAT",
        "text",
        "`json`: one JSON object a line, with the trace and span ids (see [Observability](#observability))",
    )
    http_port: Port = setting(
        "RACKPLANE_HTTP_PORT",
        0,
        "the port of the process's `/metrics`, `/healthz` and `/readyz`; `0`: one the system picks (logged, "
        "and in the stats reply)",
    )
    http_host: str = setting(
        "RACKPLANE_HTTP_HOST", "127.0.0.1", "the address they listen on (`0.0.0.0` in docker-compose.yml)"
    )
    event_v1: Flag = setting(
        "RACKPLANE_EVENT_V1",
        True,
        "instance-manager: also send `rp.evt.instance.changed` v1 beside v2 (the deprecation window, while "
        "readers that know only v1 may still be running; `0` or `off` sends v2 alone, see "
        "[subjects.md](subjects.md#a-worked-example-rpevtinstancechanged-v2))",
        shown="on",
    )
    faults: Flag = setting(
        "RACKPLANE_FAULTS",
        False,
        "`1`: the service answers fault injection (`rp.svc.<service>.faults`, from the test identity only)",
        shown="off",
    )
    crash_at: CrashPoints = setting(
        "RACKPLANE_CRASH_AT",
        frozenset(),
        "tests only: crash points, comma-separated, where the process dies as kill -9 would "
        "(shared/crash.py)",
        shown="(none)",
    )

    # migrations
    migrations: Literal["auto", "skip", "only"] = setting(
        "RACKPLANE_MIGRATE",
        "auto",
        "`auto`: apply pending migrations at start; `only`: apply them and exit; `skip`: apply none, and "
        "refuse to start unless the schema is current (see [Migrations](#migrations))",
    )
    migration_lock_timeout: Duration = setting(
        "RACKPLANE_MIGRATE_LOCK_TIMEOUT",
        10.0,
        "how long a migration waits for a table lock before it fails (and leaves the schema as it was)",
    )

    # the sled-agent simulator
    sled_nkeys: Path | None = setting(
        "RACKPLANE_SLED_NKEYS",
        None,
        "the sled agent: the folder of the sleds' seeds (`sled-<n>.nk`), one connection per sled",
    )
    sleds: int = setting("RACKPLANE_SLEDS", 8, "simulated sleds", ge=0)
    sled_vcpus: int = setting("RACKPLANE_SLED_VCPUS", 64, "each simulated sled's vCPUs", gt=0)
    sled_ram_gib: int = setting("RACKPLANE_SLED_RAM_GIB", 256, "each simulated sled's RAM, GiB", gt=0)
    sled_shapes: Shapes = setting(
        "RACKPLANE_SLED_SHAPES",
        None,
        "per-sled capacities, `VCPUS:RAM_GIB` comma-separated, used in turn",
        shown="(the two above)",
    )
    vmm_start_delay: Delay = setting("RACKPLANE_VMM_START_DELAY", 0.2, "simulated VMM boot time")
    vmm_stop_delay: Delay = setting("RACKPLANE_VMM_STOP_DELAY", 0.1, "simulated VMM shutdown time")
    migrate_delay: Delay = setting("RACKPLANE_MIGRATE_DELAY", 0.3, "simulated live migration time of a VMM")
    migrate_timeout: Duration = setting(
        "RACKPLANE_MIGRATE_TIMEOUT", 20.0, "how long a live migration's target sled waits for its source"
    )
    report_retry: Duration = setting(
        "RACKPLANE_REPORT_RETRY", 1.0, "how long a sled waits before resending an unacknowledged report"
    )
    inventory_interval: Duration = setting(
        "RACKPLANE_INVENTORY_INTERVAL", 5.0, "how often each sled publishes its inventory"
    )
    sim_state: Path | None = setting(
        "RACKPLANE_SIM_STATE",
        None,
        "where simulated sleds keep their state across simulator restarts (`make run`: `.rackplane/sim`)",
        shown="(none: in memory)",
    )

    # instance-manager and recovery
    reconcile_interval: Duration = setting(
        "RACKPLANE_RECONCILE_INTERVAL",
        10.0,
        "recovery's pass interval (a sled's later boot also starts a pass at once)",
    )
    restart_cooldown: Delay = setting(
        "RACKPLANE_RESTART_COOLDOWN",
        60.0,
        "least time between two automatic restarts of one instance, counted from the last (stops crash "
        "loops)",
    )
    restart_backoff_max: Delay = setting(
        "RACKPLANE_RESTART_BACKOFF_MAX",
        300.0,
        "longest wait between automatic restarts: the cooldown doubles with each restart in a row that "
        "found no room or quota, up to this",
    )
    saga_resume_interval: Duration = setting(
        "RACKPLANE_SAGA_RESUME_INTERVAL",
        2.0,
        "how often instance-manager looks for unfinished sagas no process runs",
    )
    inventory_ttl: Duration | None = setting(
        "RACKPLANE_INVENTORY_TTL",
        None,
        "how long the broker keeps a sled's inventory (each is superseded by the sled's next one; a "
        "reader away longer reads the newest that are left)",
        shown="10 times the inventory interval, at least 60 s",
    )
    sled_unknown_after: Duration | None = setting(
        "RACKPLANE_SLED_UNKNOWN_AFTER",
        None,
        "silence after which a sled's instances show health `unknown` (never failed)",
        shown="3 times the inventory interval",
    )
    transition_timeout: Duration = setting(
        "RACKPLANE_TRANSITION_TIMEOUT",
        60.0,
        "how long an instance may stay starting or stopping before recovery checks it against its sled",
    )
    zombie_grace: Delay = setting(
        "RACKPLANE_ZOMBIE_GRACE",
        10.0,
        "how long a VMM nobody expects may run before it is destroyed (recovery's wait, and "
        "instance-manager's for an ended record)",
    )
    retention: Duration = setting(
        "RACKPLANE_RETENTION",
        7 * 86400.0,
        "how long instance-manager keeps finished records before pruning them (see [Pruning](#pruning))",
        shown="`7d`",
    )
    prune_interval: Duration = setting("RACKPLANE_PRUNE_INTERVAL", 60.0, "how often instance-manager prunes")

    # tenant limits (instance-manager): the rack's defaults; the fleet operator sets a silo's own
    # (`rackctl silo limits`), and `rackctl silo show` shows them
    silo_max_projects: int = setting(
        "RACKPLANE_SILO_MAX_PROJECTS",
        500,
        "most projects a silo may hold, unless it has a limit of its own",
        ge=0,
    )
    silo_max_instances: int = setting(
        "RACKPLANE_SILO_MAX_INSTANCES",
        10_000,
        "most instances (warm-pool VMs included) a silo may hold before a create is refused, unless it has "
        "a limit of its own",
        ge=0,
    )
    silo_max_pool_members: int = setting(
        "RACKPLANE_SILO_MAX_POOL_MEMBERS",
        1_000,
        "most VMs a silo's warm pools may be sized to keep, all pools together, unless it has a limit of "
        "its own",
        ge=0,
    )
    silo_command_rate: int = setting(
        "RACKPLANE_SILO_COMMAND_RATE",
        200,
        "commands a second a silo may send to instance-manager (a token bucket per replica), unless it has "
        "a rate of its own; past it a command is answered `limited: retry after N ms`",
        ge=1,
    )
    identity_command_rate: int = setting(
        "RACKPLANE_IDENTITY_COMMAND_RATE",
        100,
        "commands a second one identity may send to one silo (a token bucket per replica), or the silo's "
        "own rate if it has a higher one",
        ge=1,
    )
    command_burst: Duration = setting(
        "RACKPLANE_COMMAND_BURST",
        2.0,
        "how many seconds' worth of commands a full bucket lets through at once",
    )
    saga_backlog: Duration = setting(
        "RACKPLANE_SAGA_BACKLOG",
        5.0,
        "seconds of saga work an instance-manager replica takes in hand (sagas under way over sagas "
        "finished a second); past it a create, start or migrate is answered `busy: retry after N ms`",
    )

    # the broker
    ack_wait: Duration = setting(
        "RACKPLANE_ACK_WAIT",
        30.0,
        "how long JetStream waits for a consumer's ack before redelivering (set when a durable consumer "
        "is created)",
    )
    batch_linger: Delay = setting(
        "RACKPLANE_BATCH_LINGER",
        0.015,
        "how long a batch consumer or an outbox relay whose last batch found company (a consumer's fetch "
        "of more than one message, a relay's round with rows committed while it published; either under "
        "a quarter of a full batch) waits before it fetches or publishes again, so that under load its "
        "batches grow and each message costs less; a message that comes alone is never held, nor does a "
        "consumer whose catching up others wait on (instance-manager's inventories and reports). 0: never",
    )
    duplicate_window: Duration = setting(
        "RACKPLANE_DUPLICATE_WINDOW",
        120.0,
        "how long the broker remembers a message id to drop its repeats (set on each stream when it is "
        "made or updated; past it, the receivers' own fences catch a resend). Accounting reads it too (it "
        "does not resend a repeat's outcome inside half of it): give every process the streams' value",
    )

    stream_replicas: int = setting(
        "RACKPLANE_STREAM_REPLICAS",
        1,
        "deploy: copies the broker keeps of each stream, a new subscriber's included (`3` on a three-node "
        "cluster, `make run HA=1`; rackplane's own streams are brought to it when they exist)",
        ge=1,
        le=5,
    )

    @model_validator(mode="after")
    def _url_from_file(self) -> Settings:
        if "database_url" not in self.model_fields_set and self.database_url_file is not None:
            try:
                self.database_url = self.database_url_file.read_text().strip()
            except OSError as e:
                raise ValueError(
                    f"DATABASE_URL_FILE={str(self.database_url_file)!r}: cannot read it: {e.strerror}"
                ) from e
        return self

    @model_validator(mode="after")
    def _inventories_outlive_their_interval(self) -> Settings:
        if self.inventory_ttl is not None and self.inventory_ttl < self.inventory_interval:
            raise ValueError(
                f"RACKPLANE_INVENTORY_TTL='{self.inventory_ttl:g}': expected at least the inventory interval "
                f"({self.inventory_interval:g}s), or a sled's inventory is gone before its next one comes"
            )
        return self

    def inventory_keep(self) -> float:
        """How long the broker keeps a sled's inventory: RACKPLANE_INVENTORY_TTL, or its default."""
        return self.inventory_ttl or max(60.0, 10 * self.inventory_interval)

    def unknown_after(self) -> float:
        """Silence after which a sled's instances show health `unknown`: RACKPLANE_SLED_UNKNOWN_AFTER, or
        its default."""
        return self.sled_unknown_after or 3 * self.inventory_interval

    @classmethod
    def from_env(cls) -> Settings:
        """The settings of this process's environment; a bad value raises `ConfigError` naming it."""
        return read(cls)


@cache
def settings() -> Settings:
    """This process's settings, read once: service.run reads them first (so a bad value stops the process
    at once) and hands them to the service's `main`, which passes them to what it builds. Read here too:
    the fault switch (service.serve_faults, one for the whole process) and the accessors below."""
    return Settings.from_env()


def table() -> str:
    """Every variable of `Settings` as the markdown table of docs/architecture.md."""
    return markdown_table(Settings)


if __name__ == "__main__":
    sys.stdout.write(table())
