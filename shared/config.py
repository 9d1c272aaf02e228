"""Settings from the environment, the same names for every service, in one class.

`Settings` lists every variable a service process reads, with its default and what it means; a value it
cannot have stops the process with one line naming the variable and what it expects (`ConfigError`).
`python -m shared.config` prints them as the table in docs/architecture.md (tests/test_config.py keeps the
two equal).
"""

from __future__ import annotations

import os
import re
import sys
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

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


class ConfigError(ValueError):
    """A setting whose value it cannot have; the message names the variable, and the process stops."""


# --- value types: each refuses a bad value with what it expects ------------------------------------------

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_DURATION_FORMS = "seconds or a duration such as 90s, 30m, 12h or 7d"


def parse_duration(text: str) -> float:
    """`text` in seconds: a number of seconds, or a duration such as 90s, 30m, 12h, 7d, 2w; -1 if neither."""
    m = _DURATION.fullmatch(text.strip().lower())
    return float(m[1]) * _UNITS[m[2] or "s"] if m else -1.0


def _seconds(raw: Any, *, zero: bool) -> Any:
    if not isinstance(raw, str):
        return raw
    seconds = parse_duration(raw)
    if seconds < 0 or (seconds == 0 and not zero):
        raise ValueError(f"expected {'' if zero else 'positive '}{_DURATION_FORMS}")
    return seconds


Duration = Annotated[float, BeforeValidator(lambda v: _seconds(v, zero=False)), Field(gt=0)]
"""Seconds above zero: a number of seconds, or a number with s, m, h, d or w."""
Delay = Annotated[float, BeforeValidator(lambda v: _seconds(v, zero=True)), Field(ge=0)]
"""Like `Duration`, zero allowed (no wait at all)."""


_FLAGS = {
    **dict.fromkeys(("1", "on", "true", "yes"), True),
    **dict.fromkeys(("0", "off", "false", "no"), False),
}


def _flag(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    if raw.strip().lower() not in _FLAGS:
        raise ValueError("expected 1 or 0 (on/off, true/false, yes/no)")
    return _FLAGS[raw.strip().lower()]


Flag = Annotated[bool, BeforeValidator(_flag)]
"""On or off: 1, on, true, yes or 0, off, false, no (any case)."""


def _shapes(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        shapes = [tuple(int(n) for n in shape.split(":")) for shape in raw.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) <= 0 for s in shapes):
        raise ValueError("expected VCPUS:RAM_GIB pairs, comma-separated, such as 64:256,32:128")
    return shapes


def _points(raw: Any) -> Any:
    return frozenset(p.strip() for p in raw.split(",") if p.strip()) if isinstance(raw, str) else raw


def _traces(raw: str) -> str:
    if raw in ("none", "console", "otlp") or (raw.startswith("file:") and len(raw) > 5):
        return raw
    raise ValueError("expected none, console, otlp or file:PATH")


def _port(raw: Any) -> int:
    text = str(raw).strip()
    if not text.isdigit() or int(text) > 65535:
        raise ValueError("expected a port number from 0 to 65535")
    return int(text)


def _log_format(raw: str) -> str:
    if raw.strip().lower() in ("text", "json"):
        return raw.strip().lower()
    raise ValueError("expected text or json")


def _level(raw: str) -> str:
    if raw.upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        return raw.upper()
    raise ValueError("expected DEBUG, INFO, WARNING, ERROR or CRITICAL")


def _var(name: str, default: Any, about: str, shown: str | None = None, **bounds: Any) -> Any:
    """A field read from the variable `name`; `shown` is the default as the docs' table shows it, and
    `bounds` are pydantic's (ge=0...)."""
    extra = {"shown_default": shown} if shown is not None else None
    return Field(default, validation_alias=name, description=about, json_schema_extra=extra, **bounds)


class Settings(BaseSettings):
    """Every setting of a service process, read from its environment (an empty value counts as unset)."""

    model_config = SettingsConfigDict(env_ignore_empty=True, extra="ignore", populate_by_name=True)

    # connections
    nats_url: str = _var(
        "NATS_URL",
        DEFAULT_NATS_URL,
        "the broker (`tls://...` with TLS); a cluster's nodes comma-separated (`make run HA=1`)",
    )
    nats_nkey_file: str | None = _var(
        "NATS_NKEY_FILE", None, "the process's own NATS credential, an nkey seed file (docs/security.md)"
    )
    nats_ca_file: str | None = _var(
        "NATS_CA_FILE", None, "the CA of the broker's certificate: the connection then uses TLS"
    )
    database_url: str = _var(
        "DATABASE_URL",
        DEFAULT_DATABASE_URL,
        "the database, as the service's own login role (each service uses its own schema; see "
        "[security.md](security.md#database-roles))",
    )
    database_url_file: Path | None = _var(
        "DATABASE_URL_FILE",
        None,
        "a file holding the database URL, read when `DATABASE_URL` is unset (docker-compose.yml)",
    )
    log_level: Annotated[str, BeforeValidator(_level)] = _var("RACKPLANE_LOG", "INFO", "log level")
    traces: Annotated[str, BeforeValidator(_traces)] = _var(
        "RACKPLANE_TRACES",
        "none",
        "`console`, `otlp` (standard `OTEL_EXPORTER_OTLP_*` settings), `file:PATH` (JSON lines)",
    )
    log_format: Annotated[str, BeforeValidator(_log_format)] = _var(
        "RACKPLANE_LOG_FORMAT",
        "text",
        "`json`: one JSON object a line, with the trace and span ids (see [Observability](#observability))",
    )
    http_port: Annotated[int, BeforeValidator(_port)] = _var(
        "RACKPLANE_HTTP_PORT",
        0,
        "the port of the process's `/metrics`, `/healthz` and `/readyz`; `0`: one the system picks (logged, "
        "and in the stats reply)",
    )
    http_host: str = _var(
        "RACKPLANE_HTTP_HOST", "127.0.0.1", "the address they listen on (`0.0.0.0` in docker-compose.yml)"
    )
    event_v1: Flag = _var(
        "RACKPLANE_EVENT_V1",
        True,
        "instance-manager: also send `rp.evt.instance.changed` v1 beside v2 (the deprecation window, while "
        "readers that know only v1 may still be running; `0` or `off` sends v2 alone, see "
        "[subjects.md](subjects.md#a-worked-example-rpevtinstancechanged-v2))",
        shown="on",
    )
    faults: Flag = _var(
        "RACKPLANE_FAULTS",
        False,
        "`1`: the service answers fault injection (`rp.svc.<service>.faults`, from the test identity only)",
        shown="off",
    )
    crash_at: Annotated[frozenset[str], NoDecode, BeforeValidator(_points)] = _var(
        "RACKPLANE_CRASH_AT",
        frozenset(),
        "tests only: crash points, comma-separated, where the process dies as kill -9 would "
        "(shared/crash.py)",
        shown="(none)",
    )

    # migrations
    migrations: Literal["auto", "skip", "only"] = _var(
        "RACKPLANE_MIGRATE",
        "auto",
        "`auto`: apply pending migrations at start; `only`: apply them and exit; `skip`: apply none, and "
        "refuse to start unless the schema is current (see [Migrations](#migrations))",
    )
    migration_lock_timeout: Duration = _var(
        "RACKPLANE_MIGRATE_LOCK_TIMEOUT",
        10.0,
        "how long a migration waits for a table lock before it fails (and leaves the schema as it was)",
    )

    # the sled-agent simulator
    sled_nkeys: Path | None = _var(
        "RACKPLANE_SLED_NKEYS",
        None,
        "the sled agent: the folder of the sleds' seeds (`sled-<n>.nk`), one connection per sled",
    )
    sleds: int = _var("RACKPLANE_SLEDS", 8, "simulated sleds", ge=0)
    sled_vcpus: int = _var("RACKPLANE_SLED_VCPUS", 64, "each simulated sled's vCPUs", gt=0)
    sled_ram_gib: int = _var("RACKPLANE_SLED_RAM_GIB", 256, "each simulated sled's RAM, GiB", gt=0)
    sled_shapes: Annotated[list[tuple[int, int]] | None, NoDecode, BeforeValidator(_shapes)] = _var(
        "RACKPLANE_SLED_SHAPES",
        None,
        "per-sled capacities, `VCPUS:RAM_GIB` comma-separated, used in turn",
        shown="(the two above)",
    )
    vmm_start_delay: Delay = _var("RACKPLANE_VMM_START_DELAY", 0.2, "simulated VMM boot time")
    vmm_stop_delay: Delay = _var("RACKPLANE_VMM_STOP_DELAY", 0.1, "simulated VMM shutdown time")
    migrate_delay: Delay = _var("RACKPLANE_MIGRATE_DELAY", 0.3, "simulated live migration time of a VMM")
    migrate_timeout: Duration = _var(
        "RACKPLANE_MIGRATE_TIMEOUT", 20.0, "how long a live migration's target sled waits for its source"
    )
    report_retry: Duration = _var(
        "RACKPLANE_REPORT_RETRY", 1.0, "how long a sled waits before resending an unacknowledged report"
    )
    inventory_interval: Duration = _var(
        "RACKPLANE_INVENTORY_INTERVAL", 5.0, "how often each sled publishes its inventory"
    )
    sim_state: Path | None = _var(
        "RACKPLANE_SIM_STATE",
        None,
        "where simulated sleds keep their state across simulator restarts (`make run`: `.rackplane/sim`)",
        shown="(none: in memory)",
    )

    # instance-manager and recovery
    reconcile_interval: Duration = _var(
        "RACKPLANE_RECONCILE_INTERVAL",
        10.0,
        "recovery's pass interval (a sled's later boot also starts a pass at once)",
    )
    restart_cooldown: Delay = _var(
        "RACKPLANE_RESTART_COOLDOWN",
        60.0,
        "least time between two automatic restarts of one instance, counted from the last (stops crash "
        "loops)",
    )
    restart_backoff_max: Delay = _var(
        "RACKPLANE_RESTART_BACKOFF_MAX",
        300.0,
        "longest wait between automatic restarts: the cooldown doubles with each restart in a row that "
        "found no room or quota, up to this",
    )
    saga_resume_interval: Duration = _var(
        "RACKPLANE_SAGA_RESUME_INTERVAL",
        2.0,
        "how often instance-manager looks for unfinished sagas no process runs",
    )
    inventory_ttl: Duration | None = _var(
        "RACKPLANE_INVENTORY_TTL",
        None,
        "how long the broker keeps a sled's inventory (each is superseded by the sled's next one; a "
        "reader away longer reads the newest that are left)",
        shown="10 times the inventory interval, at least 60 s",
    )
    sled_unknown_after: Duration | None = _var(
        "RACKPLANE_SLED_UNKNOWN_AFTER",
        None,
        "silence after which a sled's instances show health `unknown` (never failed)",
        shown="3 times the inventory interval",
    )
    transition_timeout: Duration = _var(
        "RACKPLANE_TRANSITION_TIMEOUT",
        60.0,
        "how long an instance may stay starting or stopping before recovery checks it against its sled",
    )
    zombie_grace: Delay = _var(
        "RACKPLANE_ZOMBIE_GRACE",
        10.0,
        "how long a VMM nobody expects may run before it is destroyed (recovery's wait, and "
        "instance-manager's for an ended record)",
    )
    retention: Duration = _var(
        "RACKPLANE_RETENTION",
        7 * 86400.0,
        "how long instance-manager keeps finished records before pruning them (see [Pruning](#pruning))",
        shown="`7d`",
    )
    prune_interval: Duration = _var("RACKPLANE_PRUNE_INTERVAL", 60.0, "how often instance-manager prunes")

    # tenant limits (instance-manager): the rack's defaults; the fleet operator sets a silo's own
    # (`rackctl silo limits`), and `rackctl silo show` shows them
    silo_max_projects: int = _var(
        "RACKPLANE_SILO_MAX_PROJECTS",
        500,
        "most projects a silo may hold, unless it has a limit of its own",
        ge=0,
    )
    silo_max_instances: int = _var(
        "RACKPLANE_SILO_MAX_INSTANCES",
        10_000,
        "most instances (warm-pool VMs included) a silo may hold before a create is refused, unless it has "
        "a limit of its own",
        ge=0,
    )
    silo_max_pool_members: int = _var(
        "RACKPLANE_SILO_MAX_POOL_MEMBERS",
        1_000,
        "most VMs a silo's warm pools may be sized to keep, all pools together, unless it has a limit of "
        "its own",
        ge=0,
    )
    silo_command_rate: int = _var(
        "RACKPLANE_SILO_COMMAND_RATE",
        200,
        "commands a second a silo may send to instance-manager (a token bucket per replica), unless it has "
        "a rate of its own; past it a command is answered `limited: retry after N ms`",
        ge=1,
    )
    identity_command_rate: int = _var(
        "RACKPLANE_IDENTITY_COMMAND_RATE",
        100,
        "commands a second one identity may send to one silo (a token bucket per replica), or the silo's "
        "own rate if it has a higher one",
        ge=1,
    )
    command_burst: Duration = _var(
        "RACKPLANE_COMMAND_BURST",
        2.0,
        "how many seconds' worth of commands a full bucket lets through at once",
    )
    saga_backlog: Duration = _var(
        "RACKPLANE_SAGA_BACKLOG",
        5.0,
        "seconds of saga work an instance-manager replica takes in hand (sagas under way over sagas "
        "finished a second); past it a create, start or migrate is answered `busy: retry after N ms`",
    )

    # the broker
    ack_wait: Duration = _var(
        "RACKPLANE_ACK_WAIT",
        30.0,
        "how long JetStream waits for a consumer's ack before redelivering (set when a durable consumer "
        "is created)",
    )
    duplicate_window: Duration = _var(
        "RACKPLANE_DUPLICATE_WINDOW",
        120.0,
        "how long the broker remembers a message id to drop its repeats (set on each stream when it is "
        "made or updated; past it, the receivers' own fences catch a resend). Accounting reads it too (it "
        "does not resend a repeat's outcome inside half of it): give every process the streams' value",
    )

    stream_replicas: int = _var(
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

    @classmethod
    def from_env(cls) -> Settings:
        """The settings of this process's environment; a bad value raises `ConfigError` naming it."""
        try:
            return cls()
        except ValidationError as e:
            raise ConfigError(_one_line(e)) from None


def _one_line(e: ValidationError) -> str:
    """The first bad variable, its value and what it expects."""
    err = e.errors()[0]
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:  # raised by a model validator, already naming its variable
        return msg
    name = str(err["loc"][0])  # the variable: every field is read by its alias
    if err["type"] == "literal_error":
        msg = msg.replace("Input should be", "expected")
    return f"{name}={err['input']!r}: {msg[0].lower()}{msg[1:]}"


@cache
def settings() -> Settings:
    """This process's settings, read once (service.run reads them first, so a bad value stops it at once)."""
    return Settings.from_env()


# What several modules read, by name: recovery acts on these timings, and instance-manager shows them (an
# instance's health and its next automatic restart).


def restart_cooldown() -> float:
    return settings().restart_cooldown


def restart_backoff_max() -> float:
    return settings().restart_backoff_max


def zombie_grace() -> float:
    return settings().zombie_grace


def inventory_ttl() -> float:
    s = settings()
    return s.inventory_ttl or max(60.0, 10 * s.inventory_interval)


def sled_unknown_after() -> float:
    s = settings()
    return s.sled_unknown_after or 3 * s.inventory_interval


def transition_timeout() -> float:
    return settings().transition_timeout


def duplicate_window() -> float:
    return settings().duplicate_window


def ack_wait() -> float:
    return settings().ack_wait


def stream_replicas() -> int:
    return settings().stream_replicas


def event_v1() -> bool:
    return settings().event_v1


class RackctlSettings(BaseSettings):
    """What rackctl reads from the environment besides its context (rackctl/context.py) and NATS_URL."""

    model_config = SettingsConfigDict(env_ignore_empty=True, extra="ignore", populate_by_name=True)

    dead_letter_alert: Duration = _var(
        "RACKPLANE_DLQ_ALERT",
        3600.0,
        "`rackctl check` reports the dead letters younger than this",
        shown="`1h`",
    )

    @classmethod
    def from_env(cls) -> RackctlSettings:
        try:
            return cls()
        except ValidationError as e:
            raise ConfigError(_one_line(e)) from None


def dead_letter_alert() -> float:
    return RackctlSettings.from_env().dead_letter_alert


# --- the table in docs/architecture.md ---------------------------------------------------------------------


def table() -> str:
    """Every variable of `Settings` as a markdown table: variable, default, meaning."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for field in Settings.model_fields.values():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        rows.append(
            f"| `{field.validation_alias}` | {extra.get('shown_default') or _shown(field.default)} | "
            f"{field.description} |"
        )
    return "\n".join(rows) + "\n"


def _shown(default: Any) -> str:
    if default is None:
        return "(none)"
    if isinstance(default, float):
        return f"`{default:g}` s"
    return f"`{default}`"


if __name__ == "__main__":
    sys.stdout.write(table())
