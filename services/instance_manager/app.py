"""The instance-manager's shared state and the few operations every flow uses."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from services.instance_manager.saga import Executor
from shared import bus, subjects, telemetry
from shared.config import event_v1, restart_backoff_max, restart_cooldown, sled_unknown_after
from shared.db import OutboxRelay, enqueue_many, queries
from shared.messages import (
    InstanceChanged,
    InstanceChangedV2,
    InstanceView,
    InstanceViewV2,
    Model,
    ProvisionDelta,
    ProvisionOutcome,
)

log = logging.getLogger(__name__)

SOURCE = "instance-manager"
CHARGE_RESEND_MAX = 30.0
"""The longest a charge waits between two sends of its delta."""
OUTCOME_CHANNEL = "charge_outcome"
"""PostgreSQL's notification channel for recorded outcomes (queries.sql outcomes_insert)."""
LISTEN_CHECK_EVERY = 30.0
"""Seconds between two checks that the connection listening for outcomes still answers."""
INVENTORIES_FIRST = 5.0
"""The longest a lost order waits for the inventories before it (App.inventories_first), and a stuck order
for the reports and inventories (App.reports_first), counted from its arrival: half of recovery's 10 s for
an answer, the other half for its turn and its transaction."""
Q = queries(Path(__file__).parent / "queries.sql")


@dataclass
class Waiter:
    """A charge waiting for its outcome: woken when one is recorded (here or by another replica); given
    the outcome itself when this process recorded it, so that it need not read it back."""

    heard: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: tuple[str, str] | None = None


@dataclass
class App:
    pool: asyncpg.Pool
    nc: NATS
    js: JetStreamContext
    dsn: str
    saga_pool: asyncpg.Pool
    """The sagas' own connections. Hundreds of sagas under way (a rack's worth of
    restarts) would otherwise queue the inventories and reports that tell the truth behind their steps."""
    relay: OutboxRelay = field(init=False)
    sagas: Executor = field(init=False)
    charge_timeout: float = 2.0
    """How long a charge waits for its outcome before it sends its delta again; doubled after each resend
    that the broker took, up to CHARGE_RESEND_MAX."""
    listening_since: float = field(default_factory=time.monotonic)
    """When this process began to read the sleds' inventories (monotonic clock)."""
    inventory_applied_at: float = -math.inf
    """When this process last applied a sled's inventory (monotonic clock): see `hears_sleds`."""
    send_v1: bool = field(default_factory=event_v1)
    """Whether instance events go out as v1 too (RACKPLANE_EVENT_V1): read once, so a bad value stops the
    process at start."""
    inventories_caught_up: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while no inventory waits to be applied (main.consumers); see `inventories_first`."""
    reports_caught_up: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while no VMM report waits to be applied (main.consumers); see `reports_first`."""
    _waiters: dict[tuple[uuid.UUID, int], Waiter] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.inventories_caught_up.set()  # until the inventories' consumer finds a backlog
        self.reports_caught_up.set()
        self.relay = OutboxRelay(self.pool, self.nc, self.js)
        self.sagas = Executor(self, self.dsn)

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
            await asyncio.wait_for(all_set(), INVENTORIES_FIRST)
        except TimeoutError:
            telemetry.count(counter)

    def hears_sleds(self) -> bool:
        """Whether a sled's silence means anything here yet. A sled is last seen when this service applies
        its inventory, so right after a start (a restart, a crash) every sled looks as silent as this
        process was away, until the inventories sent meanwhile are read: silence counts only once the
        process has been listening for the whole window. Likewise while it applies no inventory at all
        for a whole window: then the silence is its own (a burst of starts holding the connections and
        the cores the inventories wait for), or the whole rack's, and a start waits for the sleds' word
        rather than fail on a silence it cannot tell from its own backlog."""
        now, window = time.monotonic(), sled_unknown_after()
        return now - self.listening_since >= window and now - self.inventory_applied_at < window

    # --- events ---

    async def view(self, conn: asyncpg.Connection, instance_id: uuid.UUID) -> InstanceView:
        views = await self.views(conn, [instance_id])
        if not views:
            raise bus.NotFound(f"no instance {instance_id}")
        return views[0]

    async def views(self, conn: asyncpg.Connection, ids: list[uuid.UUID]) -> list[InstanceView]:
        """The instances `ids`, in that order, in one query."""
        rows = await conn.fetch(
            Q["instance_view"], ids, sled_unknown_after(), restart_cooldown(), restart_backoff_max()
        )
        return [InstanceView.model_validate(dict(r)) for r in rows]

    async def instance_changed(self, conn: asyncpg.Connection, instance_id: uuid.UUID) -> InstanceView:
        """Publish the instance as it now is, once the caller's transaction commits."""
        views = await self.instances_changed(conn, [instance_id])
        if not views:
            raise bus.NotFound(f"no instance {instance_id}")
        return views[0]

    async def instances_changed(self, conn: asyncpg.Connection, ids: list[uuid.UUID]) -> list[InstanceView]:
        """`instance_changed` for many instances: one query for their views, one statement for the events."""
        views = await self.views(conn, ids)
        await enqueue_many(
            conn, [e for v in views for e in instance_events(v, v1=self.send_v1)], source=SOURCE
        )
        self.relay.kick()
        return views

    async def release_charge(self, conn: asyncpg.Connection, instance_id: uuid.UUID, generation: int) -> None:
        await self.release_charges(conn, [(await self.view(conn, instance_id), generation)])

    async def release_charges(
        self, conn: asyncpg.Connection, released: list[tuple[InstanceView, int]]
    ) -> None:
        """Queue each instance's charge as of its generation: disk only (or nothing, once destroyed)."""
        await self.send_deltas(
            conn,
            [
                (
                    v,
                    _delta(
                        v, gen, vcpus=0, ram_bytes=0, disk_bytes=0 if v.state == "destroyed" else v.disk_bytes
                    ),
                )
                for v, gen in released
            ],
        )

    async def send_delta(
        self,
        conn: asyncpg.Connection,
        v: InstanceView,
        generation: int,
        *,
        vcpus: int,
        ram_bytes: int,
        disk_bytes: int,
    ) -> None:
        delta = _delta(v, generation, vcpus=vcpus, ram_bytes=ram_bytes, disk_bytes=disk_bytes)
        await self.send_deltas(conn, [(v, delta)])

    async def send_deltas(
        self, conn: asyncpg.Connection, deltas: list[tuple[InstanceView, ProvisionDelta]]
    ) -> None:
        """Mark the charges pending and queue their deltas, in two statements however many there are."""
        if not deltas:
            return
        await conn.execute(
            Q["charges_pending"], [d.instance_id for _, d in deltas], [d.generation for _, d in deltas]
        )
        await enqueue_many(
            conn,
            [
                (subjects.provision_delta(v.silo, v.project, v.id), d, f"delta:{v.id}:{d.generation}")
                for v, d in deltas
            ],
            source=SOURCE,
        )
        self.relay.kick()

    # --- charging, as a saga step ---

    async def hear_outcomes(self) -> None:
        """Wake the charges waiting here for an outcome another replica recorded: outcomes_insert notifies
        `charge_outcome` on commit. While the listening connection is down, waiters fall back to their
        resend timer; each (re)connection wakes them all to read their outcome again."""
        retry = 0.2
        while True:
            began = time.monotonic()
            try:
                conn = await asyncpg.connect(self.dsn)
                try:
                    await self._listen(conn)
                finally:
                    conn.terminate()
            except (
                OSError,
                TimeoutError,
                asyncpg.PostgresError,
                asyncpg.InterfaceError,
                asyncpg.InternalClientError,
            ) as e:
                log.info("not listening for charge outcomes: %s", e)
            if time.monotonic() - began > 30:
                retry = 0.2  # it held for a while: this loss is news, not a connection that keeps failing
            await asyncio.sleep(retry)
            retry = min(retry * 2, 5.0)

    async def _listen(self, conn: asyncpg.Connection) -> None:
        """Listen on `conn` until it is lost, asking it something now and then: a connection whose peer
        vanished without a word (half-open) would otherwise hear nothing, and say nothing, for ever."""
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _: lost.set())
        await conn.add_listener(OUTCOME_CHANNEL, self._outcome_heard)
        for waiter in self._waiters.values():
            waiter.heard.set()
        while not lost.is_set():
            try:
                await asyncio.wait_for(lost.wait(), LISTEN_CHECK_EVERY)
            except TimeoutError:
                await asyncio.wait_for(conn.fetchval("SELECT 1"), LISTEN_CHECK_EVERY)

    def _outcome_heard(self, conn: object, pid: int, channel: str, payload: str) -> None:
        instance_id, _, generation = payload.partition(":")
        if (waiter := self._waiters.get((uuid.UUID(instance_id), int(generation)))) is not None:
            waiter.heard.set()

    async def charge(self, silo: str, project: str, delta: ProvisionDelta) -> tuple[str, str]:
        """Send a charge to accounting and wait for its outcome. Idempotent: safe to call again.

        The delta's message id is derived from (instance, generation), so a resend inside the broker's
        window is dropped and one outside it is recognised by accounting's generation fence; the outcome
        comes back on the durable event stream and is recorded in charge_outcomes.
        """
        key = (delta.instance_id, delta.generation)
        waiter = self._waiters.setdefault(key, Waiter())
        wait = self.charge_timeout
        try:
            while True:
                if (known := await self._outcome(key, waiter)) is not None:
                    return known
                await self.pool.execute(Q["charges_pending"], [delta.instance_id], [delta.generation])
                try:
                    await bus.publish(
                        self.js,
                        subjects.provision_delta(silo, project, delta.instance_id),
                        delta,
                        source=SOURCE,
                        key=f"delta:{delta.instance_id}:{delta.generation}",
                    )
                    stored = True
                except Exception as e:
                    log.info("charge for %s not sent yet: %s", delta.instance_id, e)
                    stored = False
                # Sent again only when the timer runs out: a wake that brings no outcome (a listener
                # reconnecting wakes every waiter) only reads again.
                deadline = time.monotonic() + wait
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        await asyncio.wait_for(waiter.heard.wait(), left)
                    except TimeoutError:
                        break
                    waiter.heard.clear()
                    if (known := await self._outcome(key, waiter)) is not None:
                        return known
                telemetry.count("charge.waits_timed_out")
                # A stored delta is answered once accounting reads it (it may be down, or far behind after
                # an outage): sending it again then only adds load, so resends back off.
                wait = min(wait * 2, CHARGE_RESEND_MAX) if stored else self.charge_timeout
        finally:
            self._waiters.pop(key, None)

    async def _outcome(self, key: tuple[uuid.UUID, int], waiter: Waiter) -> tuple[str, str] | None:
        """The charge's outcome, if recorded: handed to the waiter by this process, else read."""
        if waiter.outcome is not None:
            return waiter.outcome
        row = await self.pool.fetchrow(Q["outcome_get"], *key)
        return (row["outcome"], row["reason"]) if row is not None else None

    async def record_outcomes(self, batch: list[bus.Delivery]) -> None:
        """Record the outcomes of charges this service sent and has no answer for yet (pending_charges),
        a batch in one transaction of three statements. Anything else changes nothing: a repeat of a
        recorded outcome is ignored, and an unsolicited one (a charge never sent, or a forgery) is
        counted and dropped."""
        outcomes: dict[tuple[uuid.UUID, int], ProvisionOutcome] = {
            (d.body.instance_id, d.body.generation): d.body for d in batch
        }
        keys = list(outcomes)
        ids, gens = [k[0] for k in keys], [k[1] for k in keys]
        async with self.pool.acquire() as conn, conn.transaction():
            answered = {
                (r["instance_id"], r["generation"])
                for r in await conn.fetch(Q["charges_answered"], ids, gens)
            }
            new = [outcomes[k] for k in keys if k in answered]
            inserted = {
                (r["instance_id"], r["generation"])
                for r in await conn.fetch(
                    Q["outcomes_insert"],
                    [o.instance_id for o in new],
                    [o.generation for o in new],
                    [o.outcome.value for o in new],
                    [o.reason for o in new],
                )
            }
            known = {
                (r["instance_id"], r["generation"]) for r in await conn.fetch(Q["outcomes_known"], ids, gens)
            }
        for key in keys:
            if key not in known:
                telemetry.count("outcomes.unsolicited")
                log.warning(
                    "dropped an outcome (%s) for a charge not pending: instance %s generation %d",
                    outcomes[key].outcome.value,
                    *key,
                )
            elif (waiter := self._waiters.get(key)) is not None:
                if key in inserted:  # recorded by this transaction, from this very message
                    waiter.outcome = (outcomes[key].outcome.value, outcomes[key].reason)
                waiter.heard.set()


def _delta(
    v: InstanceView, generation: int, *, vcpus: int, ram_bytes: int, disk_bytes: int
) -> ProvisionDelta:
    return ProvisionDelta(
        instance_id=v.id,
        project_id=v.project_id,
        silo_id=v.silo_id,
        generation=generation,
        vcpus=vcpus,
        ram_bytes=ram_bytes,
        disk_bytes=disk_bytes,
    )


def instance_events(v: InstanceView, *, v1: bool) -> list[tuple[str, Model, str | None]]:
    """What one change of an instance sends, as (subject, body, key): `rp.evt.instance.changed` v2 on its
    own subject, and v1 beside it while `v1` holds (the deprecation window, docs/subjects.md "Versions").
    Both are written to the outbox in the caller's transaction, so a reader gets both or neither; one
    that reads both finds the second a no-op (the same generation)."""
    events: list[tuple[str, Model, str | None]] = [
        (
            subjects.event(v.silo, "instance", "changed", version=2),
            InstanceChangedV2(instance=InstanceViewV2.model_validate(v.model_dump())),
            f"instance:{v.id}:{v.generation}:v2",
        )
    ]
    if v1:
        events.append(
            (
                subjects.event(v.silo, "instance", "changed"),
                InstanceChanged(instance=v),
                f"instance:{v.id}:{v.generation}",
            )
        )
    return events


def instance_reply(v: InstanceView) -> dict[str, Any]:
    return v.model_dump(mode="json")
