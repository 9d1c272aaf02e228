"""The pool keeper: a level-triggered loop that brings every warm pool's own VMs to its target size
through the ordinary create and start sagas, retiring the surplus first (services/instance_manager/pools.py
says what a pool is and how a VM is picked from it)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from services.instance_manager import lifecycle
from services.instance_manager.app import App
from services.instance_manager.pools import P, view
from services.instance_manager.sagas.create import CREATE, CreateParams
from services.instance_manager.sagas.definition import Status
from services.instance_manager.sagas.start import START, AlreadyRunning, Starter, StartParams
from shared import bus, telemetry
from shared.db import PassLock
from shared.messages import (
    AutoRestart,
    PoolView,
)
from shared.waits import woken

log = logging.getLogger(__name__)
MAX_STARTS_PER_PASS = 32
BACKOFF_FIRST = 1.0
"""Seconds a pool's keeper waits after a refused create or start before it tries again."""
BACKOFF_MAX = 60.0
"""The longest such wait: it doubles with each refusal in a row, up to this."""


@dataclass
class Backoff:
    """A pool whose creates or starts were refused (quota, room): how long its keeper waits before the
    next try, and since when."""

    wait: float = 0.0
    until: float = 0.0
    """Monotonic time before which the pool gets no create or start."""
    refused_at: float = 0.0
    """When the last refusal was heard: a success of a try begun before it resets nothing."""


class Keeper:
    """Keeps every pool at its target size; one pass at a time across replicas.

    Refusals back off, per pool and in this process's memory (a replica that takes the pass over starts
    afresh, with at most one wave of tries): after a refused create or start, the pool gets no other until
    BACKOFF_FIRST seconds have passed, then one try at a time, the wait doubling with each refusal up to
    BACKOFF_MAX; a try that succeeds resets it. A pool that does not fit its quota so costs a handful of
    destroyed instances, outcomes and ledger rows a minute, not dozens a second."""

    def __init__(self, app: App, dsn: str, interval: float = 1.0) -> None:
        self.app = app
        self.interval = interval
        self.lock = PassLock(dsn, "pool-keeper")
        self.wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.backoff: dict[uuid.UUID, Backoff] = {}

    def kick(self) -> None:
        self.wake.set()

    async def run(self) -> None:
        while True:
            try:
                async with self.lock as mine:
                    if mine:
                        kept = [r["id"] for r in await self.app.pool.fetch(P["pools_to_keep"])]
                        for gone in self.backoff.keys() - set(kept):
                            del self.backoff[gone]
                        for pool in kept:
                            await self.keep(pool)
            except Exception as e:
                log.warning("pool keeper pass failed: %s", e)
                telemetry.count("pool.keeper_errors")
            self.wake.clear()
            await woken(self.wake, self.interval)

    async def keep(self, pool: uuid.UUID) -> None:
        """One pass over one pool, level-triggered: what its members are meant to be (intended_state)
        against what they are. The surplus is retired first, so that no member is started and retired
        in the same pass; a member meant to be stopped is stopped if it runs (however it came to run) and
        deleted once at rest; members meant to run are started, and new ones made, as backoff allows."""
        async with self.app.pool.acquire() as conn:
            v = await view(conn, pool)
            members = await conn.fetch(P["members"], pool)
        target = v.target_size if v.state == "active" else 0
        active = [m for m in members if m["intended_state"] == "running"]
        retiring = [m for m in members if m["intended_state"] == "stopped"]
        surplus = [m for m in active if m["state"] in ("running", "stopped")][: max(len(active) - target, 0)]
        for m in surplus:  # stopped ones first (members' order): they cost nothing to retire
            await self._in_tx(lambda conn, m=m: lifecycle.retire(self.app, conn, m["id"]))
        for m in retiring:
            if m["state"] in ("stopped", "failed"):
                await self._in_tx(lambda conn, m=m: lifecycle.delete(self.app, conn, m["id"]))
            elif m["state"] == "running":
                await self._in_tx(lambda conn, m=m: lifecycle.retire(self.app, conn, m["id"]))
        retired = {m["id"] for m in surplus}
        to_start = [m["id"] for m in active if m["state"] == "stopped" and m["id"] not in retired]
        to_make = max(target - len(active), 0)
        if not (to_start or to_make):
            return
        tries = self._tries(pool)
        for instance_id in to_start[:tries]:
            await self._start(pool, instance_id)
        for _ in range(min(to_make, tries - len(to_start[:tries]))):
            await self._provision(pool, v)

    def _tries(self, pool: uuid.UUID) -> int:
        """How many creates and starts the pool may begin in this pass: none while it waits, one while
        it backs off (the wait begins again now, as if that one were refused too), else up to
        MAX_STARTS_PER_PASS."""
        b = self.backoff.get(pool)
        if b is None:
            return MAX_STARTS_PER_PASS
        now = time.monotonic()
        if now < b.until:
            telemetry.count("pool.backing_off")
            return 0
        b.until = now + b.wait
        return 1

    def _heard(self, pool: uuid.UUID, began: float, status: Status) -> None:
        """A create or start the keeper began has ended. A refusal doubles the pool's wait (from
        BACKOFF_FIRST, up to BACKOFF_MAX), once per wave: a try begun before the last refusal was heard
        adds nothing to it. A success of a try begun after the last refusal resets it."""
        now = time.monotonic()
        b = self.backoff.get(pool)
        if status is Status.failed:
            if b is not None and began < b.refused_at:
                return
            b = self.backoff.setdefault(pool, Backoff())
            b.wait = min(max(b.wait * 2, BACKOFF_FIRST), BACKOFF_MAX)
            b.until, b.refused_at = now + b.wait, now
            telemetry.count("pool.refused")
            log.info("pool %s: a create or start was refused: next try in %gs", pool, b.wait)
        elif status is Status.done and b is not None and began >= b.refused_at:
            del self.backoff[pool]

    async def _in_tx(self, change: Any) -> None:
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                await change(conn)
            self.app.relay.kick()
        except bus.CommandError as e:
            log.info("pool keeper: %s", e.message)

    async def _provision(self, pool: uuid.UUID, v: PoolView) -> None:
        """A new VM for the pool: the ordinary create saga, then the ordinary start saga."""
        name = f"{v.name}-{secrets.token_hex(3)}"
        instance_id = uuid.uuid4()
        params = CreateParams(
            silo=v.silo, project=v.project, name=name, vcpus=v.vcpus, ram_bytes=v.ram_bytes,
            disk_bytes=v.disk_bytes, auto_restart=AutoRestart.best_effort, instance_id=instance_id,
            project_id=v.project_id, pool_id=v.id,
        )  # fmt: skip
        began = time.monotonic()
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                saga_id = await self.app.sagas.begin(conn, CREATE, params)
        except bus.CommandError as e:
            log.info("pool %s: cannot provision: %s", v.name, e.message)
            self._heard(pool, began, Status.failed)
            return
        telemetry.count("pool.provisioned")
        self._spawn(self._create_then_start(pool, saga_id, instance_id))

    async def _create_then_start(self, pool: uuid.UUID, saga_id: uuid.UUID, instance_id: uuid.UUID) -> None:
        began = time.monotonic()
        created = await self.app.sagas.launch(saga_id)
        if created is Status.done:
            await self._start(pool, instance_id)
        else:
            self._heard(pool, began, created)

    async def _start(self, pool: uuid.UUID, instance_id: uuid.UUID) -> None:
        """Start a member: the ordinary start saga, as the pool's keeper (its interlock refuses a VM
        retired meanwhile); how it ends is heard in the background."""
        began = time.monotonic()
        try:
            async with self.app.pool.acquire() as conn, conn.transaction():
                params = StartParams(instance_id=instance_id, by=Starter.pool)
                saga_id = await self.app.sagas.begin(conn, START, params)
        except (AlreadyRunning, bus.CommandError):
            return
        self.app.relay.kick()
        self._spawn(self._hear(pool, began, self.app.sagas.launch(saga_id)))

    async def _hear(self, pool: uuid.UUID, began: float, saga: asyncio.Task[Status]) -> None:
        self._heard(pool, began, await saga)

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
