"""Settings from the environment, the same names for every service."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class Settings:
    nats_url: str
    database_url: str
    log_level: str
    nats_nkey_file: str | None = None
    """The process's own NATS credential (an nkey seed file, deploy/identities.py)."""
    nats_ca_file: str | None = None
    """The CA of the server's TLS certificate; with it the connection uses TLS."""
    faults: bool = False
    """Whether the process answers fault injection requests (RACKPLANE_FAULTS=1; tests and chaos only)."""

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            nats_url=os.environ.get("NATS_URL", DEFAULT_NATS_URL),
            database_url=os.environ.get("DATABASE_URL")
            or _from_file("DATABASE_URL_FILE")
            or DEFAULT_DATABASE_URL,
            log_level=os.environ.get("RACKPLANE_LOG", "INFO"),
            nats_nkey_file=os.environ.get("NATS_NKEY_FILE") or None,
            nats_ca_file=os.environ.get("NATS_CA_FILE") or None,
            faults=os.environ.get("RACKPLANE_FAULTS", "") not in ("", "0"),
        )


def _from_file(name: str) -> str | None:
    """A secret given as a file (docker-compose.yml's database logins), named by the variable `name`."""
    path = os.environ.get(name)
    return Path(path).read_text().strip() if path else None


class ConfigError(ValueError):
    """A setting whose value it cannot have; the message names the variable, and the process stops."""


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")


def parse_duration(text: str) -> float:
    """`text` in seconds: a number of seconds, or a duration such as 90s, 30m, 12h, 7d, 2w; 0 if neither."""
    m = _DURATION.fullmatch(text.strip().lower())
    return float(m[1]) * _UNITS[m[2] or "s"] if m else 0.0


def env_duration(name: str, default: float) -> float:
    """Seconds above zero, given as a number of seconds or as a duration such as 90s, 30m, 12h, 7d, 2w."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    seconds = parse_duration(raw)
    if seconds <= 0:
        raise ConfigError(f"{name}={raw!r}: expected seconds or a duration such as 90s, 30m, 12h or 7d")
    return seconds


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw else default


_FLAGS = {
    **dict.fromkeys(("1", "on", "true", "yes"), True),
    **dict.fromkeys(("0", "off", "false", "no"), False),
}


def env_flag(name: str, default: bool) -> bool:
    """On or off: 1, on, true, yes or 0, off, false, no (any case); unset or empty keeps the default."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw.lower() not in _FLAGS:
        raise ConfigError(f"{name}={raw!r}: expected 1 or 0 (on/off, true/false, yes/no)")
    return _FLAGS[raw.lower()]


def setup_logging(service: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )


# Recovery's timing: one definition, read by recovery (which acts on it) and by instance-manager (which
# shows it: an instance's health and its next automatic restart).


def restart_cooldown() -> float:
    """Seconds between automatic restarts of one instance, counted from the last one: stops crash loops."""
    return env_float("RACKPLANE_RESTART_COOLDOWN", 60.0)


def restart_backoff_max() -> float:
    """The longest wait between automatic restarts: the cooldown doubles with each restart in a row that
    could not start the instance (no room, no quota), up to this."""
    return env_float("RACKPLANE_RESTART_BACKOFF_MAX", 300.0)


def zombie_grace() -> float:
    """Seconds a VMM must have gone unclaimed before a sled running it is told to destroy it (judged by
    recovery, which sees it in inventories, and again by instance-manager, by its own records)."""
    return env_float("RACKPLANE_ZOMBIE_GRACE", 10.0)


def sled_unknown_after() -> float:
    """Seconds of silence after which a sled's instances are shown with health `unknown` (never failed)."""
    return env_float("RACKPLANE_SLED_UNKNOWN_AFTER", 3 * env_float("RACKPLANE_INVENTORY_INTERVAL", 5.0))


def retention() -> float:
    """How long instance-manager keeps finished records (finished sagas and their events, charge outcomes,
    ended VMM records) before its pruner deletes them; some are kept longer, see prune.py."""
    return env_duration("RACKPLANE_RETENTION", 7 * 86400.0)


def prune_interval() -> float:
    """Seconds between two prune passes."""
    return env_duration("RACKPLANE_PRUNE_INTERVAL", 60.0)


def transition_timeout() -> float:
    """Seconds an instance may stay starting or stopping before recovery checks it against its sled."""
    return env_float("RACKPLANE_TRANSITION_TIMEOUT", 60.0)


def duplicate_window() -> float:
    """Seconds the broker remembers a message id to drop its repeats (set on each stream when it is made
    or updated). Past it, a resend is caught by the receivers' own fences; chaos runs use a short one to
    prove that."""
    return env_float("RACKPLANE_DUPLICATE_WINDOW", 120.0)


def ack_wait() -> float:
    """Seconds JetStream waits for a consumer's ack before redelivering (set when a durable is created).

    Tests set it low so that a held-back ack, or a handler slower than this, is redelivered quickly.
    """
    return env_float("RACKPLANE_ACK_WAIT", 30.0)


def event_v1() -> bool:
    """Whether instance-manager still sends `rp.evt.instance.changed` v1 beside v2 (RACKPLANE_EVENT_V1, on
    by default): the deprecation window, while readers that know only v1 may still be running."""
    return env_flag("RACKPLANE_EVENT_V1", True)


def dead_letter_alert() -> float:
    """`rackctl check` reports dead letters younger than this (RACKPLANE_DLQ_ALERT, 1h by default)."""
    return env_duration("RACKPLANE_DLQ_ALERT", 3600.0)
