"""What rackctl reads from the environment besides its context (rackctl/context.py) and NATS_URL: apart
from the services' `Settings`, which rackctl never needs."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.config_values import Duration, read, setting


class RackctlSettings(BaseSettings):
    """What rackctl reads from the environment besides its context (rackctl/context.py) and NATS_URL."""

    model_config = SettingsConfigDict(env_ignore_empty=True, extra="ignore", populate_by_name=True)

    dead_letter_alert: Duration = setting(
        "RACKPLANE_DLQ_ALERT",
        3600.0,
        "`rackctl check` reports the dead letters younger than this",
        shown="`1h`",
    )

    @classmethod
    def from_env(cls) -> RackctlSettings:
        """Read from the environment; a bad value raises `ConfigError` naming it."""
        return read(cls)


def dead_letter_alert() -> float:
    return RackctlSettings.from_env().dead_letter_alert
