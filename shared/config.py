"""Settings from the environment, the same names for every service."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5433/rackplane"


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
            database_url=os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL),
            log_level=os.environ.get("RACKPLANE_LOG", "INFO"),
            nats_nkey_file=os.environ.get("NATS_NKEY_FILE") or None,
            nats_ca_file=os.environ.get("NATS_CA_FILE") or None,
            faults=os.environ.get("RACKPLANE_FAULTS", "") not in ("", "0"),
        )


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw else default


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


def sled_unknown_after() -> float:
    """Seconds of silence after which a sled's instances are shown with health `unknown` (never failed)."""
    return env_float("RACKPLANE_SLED_UNKNOWN_AFTER", 3 * env_float("RACKPLANE_INVENTORY_INTERVAL", 5.0))


def transition_timeout() -> float:
    """Seconds an instance may stay starting or stopping before recovery checks it against its sled."""
    return env_float("RACKPLANE_TRANSITION_TIMEOUT", 60.0)


def ack_wait() -> float:
    """Seconds JetStream waits for a consumer's ack before redelivering (set when a durable is created).

    Tests set it low so that a held-back ack, or a handler slower than this, is redelivered quickly.
    """
    return env_float("RACKPLANE_ACK_WAIT", 30.0)
