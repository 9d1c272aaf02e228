"""The instance-manager's shared state: its connections, the outbox relay, the saga executor and the
charges awaited (charging.py), and what it knows of its own progress (how far behind its consumers are,
whether it can judge a sled by its silence). Views and events are views.py's, charges charging.py's."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import asyncpg
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from services.instance_manager.charging import Charging
from services.instance_manager.sagas.engine import Executor
from shared import telemetry
from shared.config import Settings
from shared.db import OutboxRelay

INVENTORIES_FIRST = 5.0
"""The longest a lost order waits for the inventories before it (App.inventories_first), and a stuck order
for the reports and inventories (App.reports_first), counted from its arrival: half of recovery's 10 s for
an answer, the other half for its turn and its transaction."""


@dataclass
class App:
    pool: asyncpg.Pool
    nc: NATS
    js: JetStreamContext
    dsn: str
    saga_pool: asyncpg.Pool
    """The sagas' own connections. Hundreds of sagas under way (a rack's worth of
    restarts) would otherwise queue the inventories and reports that tell the truth behind their steps."""
    settings: Settings = field(default_factory=Settings.from_env)
    """This process's settings, read once at start (shared/service.py `run`) and passed in: the timings its
    views, orders and sagas judge by, and its limits."""
    relay: OutboxRelay = field(init=False)
    sagas: Executor = field(init=False)
    charging: Charging = field(init=False)
    """The charges this process's sagas wait for."""
    listening_since: float = field(default_factory=time.monotonic)
    """When this process began to read the sleds' inventories (monotonic clock)."""
    inventory_applied_at: float = -math.inf
    """When this process last applied a sled's inventory (monotonic clock): see `hears_sleds`."""
    send_v1: bool = field(init=False)
    """Whether instance events go out as v1 too (RACKPLANE_EVENT_V1)."""
    inventories_caught_up: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while no inventory waits to be applied (main.consumers); see `inventories_first`."""
    reports_caught_up: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while no VMM report waits to be applied (main.consumers); see `reports_first`."""

    def __post_init__(self) -> None:
        self.inventories_caught_up.set()  # until the inventories' consumer finds a backlog
        self.reports_caught_up.set()
        self.send_v1 = self.settings.event_v1
        self.relay = OutboxRelay(self.pool, self.nc, self.js, linger=self.settings.batch_linger)
        self.sagas = Executor(
            self,
            self.dsn,
            backlog=self.settings.saga_backlog,
            resume_interval=self.settings.saga_resume_interval,
        )
        self.charging = Charging(self.pool, self.relay, self.dsn)

    async def inventories_first(self) -> None:
        """Wait (at most INVENTORIES_FIRST seconds) until the inventories waiting to be applied are.
        Recording a sled's new boot is what makes the API truthful about every instance it held, all at
        once (instance_view's `lost`); failing its VMMs, order by order, records what follows from it
        (and calls off a migration to a lost target). After a rack's power loss both arrive by the
        thousand on the same cores: the boots go first."""
        await self._caught_up(self.inventories_caught_up, counter="inventories_first.waited_out")

    async def reports_first(self) -> None:
        """The same wait for the VMM reports and the inventories: a stuck order is judged on the sleds'
        latest word (orders.stuck), so what they have said already is applied first."""
        await self._caught_up(
            self.reports_caught_up, self.inventories_caught_up, counter="reports_first.waited_out"
        )

    async def _caught_up(self, *consumers: asyncio.Event, counter: str) -> None:
        """Wait, at most INVENTORIES_FIRST seconds from now, until every one of these consumers' `caught_up`
        events is set at once."""

        async def all_set() -> None:
            while not all(e.is_set() for e in consumers):
                for e in consumers:
                    await e.wait()

        try:
            async with asyncio.timeout(INVENTORIES_FIRST):
                await all_set()
        except TimeoutError:
            telemetry.count(counter)

    def hears_sleds(self) -> bool:
        """Whether a sled's silence means anything here yet. A sled is last seen when this service applies
        its inventory, so right after a start (a restart, a crash) every sled looks as silent as this
        process was away, until the inventories sent meanwhile are read: silence counts only once the
        process has been listening for the whole window. Likewise while it applies no inventory at all
        for a whole window: then the silence is its own (a burst of starts holding the connections and
        the cores the inventories wait for), or the whole rack's, and a start waits for the sleds' word
        rather than fail on a silence it cannot tell from its own backlog. And only while no inventory
        waits to be applied: one waiting may be the sled's word (under a burst, the inventories wait for
        the rows the starts' placements hold)."""
        now, window = time.monotonic(), self.settings.unknown_after()
        return (
            now - self.listening_since >= window
            and now - self.inventory_applied_at < window
            and self.inventories_caught_up.is_set()
        )
