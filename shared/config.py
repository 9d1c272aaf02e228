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

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            nats_url=os.environ.get("NATS_URL", DEFAULT_NATS_URL),
            database_url=os.environ.get("DATABASE_URL", DEFAULT_DATABASE_URL),
            log_level=os.environ.get("RACKPLANE_LOG", "INFO"),
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
