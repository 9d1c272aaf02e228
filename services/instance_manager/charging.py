"""Charges, from instance-manager's side: what an instance should be charged is built here and only here
(`delta`), sent by one path only (`queue`: marked pending and written to the outbox in the caller's
transaction), and a charge a saga waits for is awaited here (`Charging.charge`), its outcome read back as
an `Outcome`.

A charge's message id is derived from (instance, generation), so a resend inside the broker's window is
dropped and one outside it is recognised by accounting's generation fence; the outcome comes back on the
durable event stream and is recorded in charge_outcomes (`Charging.record_outcomes`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import asyncpg

from services.instance_manager.base import SOURCE, Q
from shared import bus, telemetry
from shared.db import OutboxRelay, enqueue_many
from shared.messages import InstanceState, InstanceView, Model, Outcome, ProvisionDelta, ProvisionOutcome
from shared.topology import subjects
from shared.waits import woken

log = logging.getLogger(__name__)

CHARGE_RESEND_MAX = 30.0
"""The longest a charge waits between two sends of its delta."""
OUTCOME_CHANNEL = "charge_outcome"
"""PostgreSQL's notification channel for recorded outcomes (queries.sql outcomes_insert)."""
LISTEN_CHECK_EVERY = 30.0
"""Seconds between two checks that the connection listening for outcomes still answers."""

Key = tuple[uuid.UUID, int]
"""A charge: the instance, and the generation it is charged as of."""


@dataclass(frozen=True)
class Account:
    """Whose charge it is: the instance, the project and silo it is charged to (their ids go in the
    delta, their names in its subject)."""

    instance_id: uuid.UUID
    project_id: uuid.UUID
    silo_id: uuid.UUID
    silo: str
    project: str

    @classmethod
    def of(cls, v: InstanceView) -> Account:
        return cls(v.id, v.project_id, v.silo_id, v.silo, v.project)


def delta(
    account: Account, generation: int, *, vcpus: int, ram_bytes: int, disk_bytes: int
) -> ProvisionDelta:
    """The whole charge of the instance as of `generation` (not a difference: see ProvisionDelta)."""
    return ProvisionDelta(
        instance_id=account.instance_id,
        project_id=account.project_id,
        silo_id=account.silo_id,
        generation=generation,
        vcpus=vcpus,
        ram_bytes=ram_bytes,
        disk_bytes=disk_bytes,
    )


async def queue(
    conn: asyncpg.Connection,
    charges: list[tuple[Account, ProvisionDelta]],
    *,
    before: list[tuple[str, Model, str | None]] | None = None,
) -> None:
    """The one way a delta is sent: the charges marked pending (a resend of one already answered adds
    nothing) and their deltas written to the outbox, in the caller's transaction, two statements however
    many there are; `before`: the caller's other messages (its instance events), written ahead of the
    deltas by the same statement. The caller kicks the relay once it has committed (the saga engine
    after each step, `Charging.charge`; a lifecycle change with its instance event)."""
    if not charges:
        return
    await conn.execute(
        Q["charges_pending"], [d.instance_id for _, d in charges], [d.generation for _, d in charges]
    )
    deltas: list[tuple[str, Model, str | None]] = [
        (subjects.provision_delta(a.silo, a.project, a.instance_id), d, _delta_key(d)) for a, d in charges
    ]
    await enqueue_many(conn, [*(before or []), *deltas], source=SOURCE)


def _delta_key(d: ProvisionDelta) -> str:
    """A delta's message id is made of this: a resend inside the broker's window is dropped."""
    return f"delta:{d.instance_id}:{d.generation}"


async def release(conn: asyncpg.Connection, released: list[tuple[InstanceView, int]]) -> None:
    """Queue each instance's charge as of its generation: disk only (or nothing, once destroyed)."""
    charges = []
    for v, gen in released:
        disk = 0 if v.state == InstanceState.destroyed else v.disk_bytes
        account = Account.of(v)
        charges.append((account, delta(account, gen, vcpus=0, ram_bytes=0, disk_bytes=disk)))
    await queue(conn, charges)


@dataclass
class Waiter:
    """A charge waiting for its outcome: woken when one is recorded (here or by another replica); given
    the outcome itself when this process recorded it, so that it need not read it back."""

    heard: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: tuple[Outcome, str] | None = None


@dataclass
class Charging:
    """The charges this process waits for, and what wakes them."""

    pool: asyncpg.Pool
    relay: OutboxRelay
    dsn: str
    charge_timeout: float = 2.0
    """How long a charge waits for its outcome before it sends its delta again; doubled after each resend,
    up to CHARGE_RESEND_MAX."""
    _waiters: dict[Key, Waiter] = field(default_factory=dict)

    async def charge(self, account: Account, d: ProvisionDelta, *, sent: bool = False) -> tuple[Outcome, str]:
        """Send a charge to accounting (unless the caller's committed transaction `sent` it already: then
        only when its outcome is late) and wait for its outcome. Idempotent: safe to call again."""
        key = (d.instance_id, d.generation)
        waiter = self._waiters.setdefault(key, Waiter())
        wait = self.charge_timeout
        try:
            while True:
                if (known := await self._outcome(key, waiter)) is not None:
                    return known
                if not sent:
                    async with self.pool.acquire() as conn, conn.transaction():
                        await queue(conn, [(account, d)])
                    self.relay.kick()  # committed now: the relay finds the row at once
                sent = False  # from now on, sent again each time the wait runs out
                # Sent again only when the timer runs out: a wake that brings no outcome (a listener
                # reconnecting wakes every waiter) only reads again.
                deadline = time.monotonic() + wait
                while (left := deadline - time.monotonic()) > 0:
                    if not await woken(waiter.heard, left):
                        break
                    waiter.heard.clear()
                    if (known := await self._outcome(key, waiter)) is not None:
                        return known
                telemetry.count("charge.waits_timed_out")
                # A stored delta is answered once accounting reads it (it may be down, or far behind after
                # an outage): sending it again then only adds load, so resends back off.
                wait = min(wait * 2, CHARGE_RESEND_MAX)
        finally:
            self._waiters.pop(key, None)

    async def _outcome(self, key: Key, waiter: Waiter) -> tuple[Outcome, str] | None:
        """The charge's outcome, if recorded: handed to the waiter by this process, else read."""
        if waiter.outcome is not None:
            return waiter.outcome
        row = await self.pool.fetchrow(Q["outcome_get"], *key)
        return (Outcome(row["outcome"]), row["reason"]) if row is not None else None

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
            if not await woken(lost, LISTEN_CHECK_EVERY):
                async with asyncio.timeout(LISTEN_CHECK_EVERY):
                    await conn.fetchval("SELECT 1")

    def _outcome_heard(self, conn: object, pid: int, channel: str, payload: str) -> None:
        instance_id, _, generation = payload.partition(":")
        if (waiter := self._waiters.get((uuid.UUID(instance_id), int(generation)))) is not None:
            waiter.heard.set()

    async def record_outcomes(self, batch: list[bus.Delivery]) -> None:
        """Record the outcomes of charges this service sent and has no answer for yet (pending_charges),
        a batch in one transaction of three statements. Anything else changes nothing: a repeat of a
        recorded outcome is ignored, and an unsolicited one (a charge never sent, or a forgery) is
        counted and dropped."""
        outcomes: dict[Key, ProvisionOutcome] = {
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
                    waiter.outcome = (outcomes[key].outcome, outcomes[key].reason)
                waiter.heard.set()
