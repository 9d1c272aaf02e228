"""The service timings the checks judge by: an instance is stuck, or its restart overdue, only past the
times the services themselves wait. `rackctl check` reads them from its own environment, as the services
read theirs (shared/config.py), and hands them to the checks."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import Settings


@dataclass(frozen=True)
class Timings:
    reconcile_interval: float
    transition_timeout: float
    restart_cooldown: float
    restart_backoff_max: float
    inventory_interval: float

    @classmethod
    def of(cls, s: Settings) -> Timings:
        return cls(
            reconcile_interval=s.reconcile_interval,
            transition_timeout=s.transition_timeout,
            restart_cooldown=s.restart_cooldown,
            restart_backoff_max=s.restart_backoff_max,
            inventory_interval=s.inventory_interval,
        )

    @classmethod
    def from_env(cls) -> Timings:
        """This process's: a bad value raises `ConfigError` naming it."""
        return cls.of(Settings.from_env())
