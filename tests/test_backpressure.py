"""Backpressure instead of timeouts (issue 33): an instance-manager with more sagas in hand than it finishes
within RACKPLANE_SAGA_BACKLOG answers a new start at once with `busy: retry after N ms`, having done
nothing; rackctl waits that long (with jitter), says so once on stderr, and succeeds once there is room.

The backlog is made on purpose: a tiny RACKPLANE_SAGA_BACKLOG (0.1 s: room for 3 sagas before this replica
has a rate of its own) and accounting stopped, so that the starts sent wait for their charges, in hand."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from nats.aio.msg import Msg

from rackctl.client import Client
from services.instance_manager.sagas import Executor
from services.recovery.reconcile import Reconciler
from shared import bus
from shared.messages import InstanceRestart, InstanceStart
from shared.topology import subjects
from tests.conftest import (
    GiB,
    Rack,
    assert_invariants,
    connect_as,
    counter,
    eventually,
    private_rack,
    restart_service,
)
from tests.test_cli import rackctl

BUSY = re.compile(r"busy: retry after (\d+) ms \((\d+) sagas in hand, (\d+) finished a second\)")


@pytest.fixture(scope="module")
async def rack() -> AsyncIterator[Rack]:
    async with private_rack("busy", timeout=60, RACKPLANE_SLEDS="2", RACKPLANE_SAGA_BACKLOG="0.1") as made:
        yield made


async def start_once(client: Client, silo: str, name: str) -> bus.CommandError | None:
    """One start, sent once (no retry): the refusal, or None if it was taken."""
    body = InstanceStart(silo=silo, project="p", name=name)
    try:
        await bus.request(
            client.nc, subjects.command(silo, "instance", "start"), body, source="test", timeout=30
        )
    except bus.CommandError as e:
        return e
    return None


async def test_busy_is_answered_at_once_and_the_cli_retries_to_success(rack: Rack) -> None:
    stack, client, db = rack
    silo = "busy"
    await client.silo_create(silo)
    await client.project_create(silo, "p")
    for i in range(6):  # one at a time: a create is a saga too, and each finishes before the next
        await client.instance_create(silo, "p", f"vm-{i}", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

    stack.services["accounting"].stop()  # a start's charge now waits: its saga stays in hand
    sent = {f"vm-{i}": asyncio.create_task(start_once(client, silo, f"vm-{i}")) for i in range(5)}
    await asyncio.wait(sent.values(), timeout=2)  # a refusal comes at once; a start taken, in 10 s
    refused = {n: t.result() for n, t in sent.items() if t.done()}  # the taken ones wait for accounting
    held = {n: t for n, t in sent.items() if not t.done()}
    assert refused and len(held) >= 2, (refused, held)
    for e in refused.values():
        assert e is not None and e.code == "busy", e
        m = BUSY.fullmatch(e.message)
        assert m, e.message
        assert 0 < int(m[1]) <= 1000 and int(m[2]) >= len(held), e.message

    busy_before = await counter(client, "instance-manager", "commands.busy")
    again = min(refused)
    cli = asyncio.create_task(rackctl(stack, "instance", "start", f"{silo}/p/{again}", "--timeout", "60"))

    async def cli_told_busy() -> bool:
        return await counter(client, "instance-manager", "commands.busy") > busy_before

    await eventually(cli_told_busy)
    assert not cli.done()  # still retrying, not failed
    restart_service(stack, "accounting")  # the charges go through, the sagas finish, room is made

    run = await cli
    assert run.code == 0, run
    lines = run.err.splitlines()
    assert len(lines) == 1 and re.fullmatch(r"instance-manager busy: retrying in \d+ ms", lines[0]), lines
    assert [await t for t in held.values()] == [None] * len(held)  # taken: answered once their sagas ended

    started = [*held, again]
    running = "SELECT count(*) FROM instance_manager.instances WHERE name = any($1) AND state = 'running'"

    async def all_running() -> bool:
        return await db.fetchval(running, started) == len(started)

    await eventually(all_running, timeout=20)
    hurt = "SELECT count(*) FROM instance_manager.instances WHERE failed_at IS NOT NULL OR last_error > ''"
    assert await db.fetchval(hurt) == 0
    await assert_invariants(db)


def test_busy_is_the_backlog_over_the_measured_rate() -> None:
    """The rule's arithmetic: in hand past RACKPLANE_SAGA_BACKLOG seconds of the rate (25 a second until
    more is measured) is busy, for as long as the excess takes to drain."""
    sagas = Executor(app=None, dsn="", backlog=2.0)
    assert sagas.busy() is None
    sagas.active = 49  # 50 would be 2 s at 25 a second
    assert sagas.busy() is None
    assert sagas.busy(starting=1) == (40, 50, 25.0)  # one past: 1/25 s
    now = time.monotonic()
    for _ in range(400):
        sagas.pace.tick(now)
    ms, in_hand, rate = sagas.busy(starting=800 - 49) or (0, 0, 0.0)
    assert in_hand == 800 and rate >= 200 and 0 < ms <= 2000, (ms, in_hand, rate)
    assert sagas.busy(starting=10) is None  # 400 finished in the last second: room for 800


async def test_restart_orders_past_the_backlog_are_told_busy_and_asked_again(rack: Rack) -> None:
    """After a power loss, recovery's restarts wait in recovery, not as sagas begun (and charged) in
    instance-manager: past the backlog of sagas nobody waits for, a restart order is refused `busy` at
    once, and recovery orders it again when told. With accounting stopped no restart can finish, so the
    sagas in hand stay at the backlog (0.1 s at 25 a second: 3) while every other order is refused."""
    stack, client, db = rack
    silo = "restarts"
    await client.silo_create(silo)
    await client.project_create(silo, "p")
    names = [f"r-{i}" for i in range(16)]
    for n in names:
        await client.instance_create(silo, "p", n, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        await client.instance("start", silo, "p", n)
    busy_before = await counter(client, "recovery", "reconcile.restart_busy")

    stack.services["accounting"].stop()
    await client.sim_rack_reboot()

    async def restarts_told_busy() -> bool:
        return await counter(client, "recovery", "reconcile.restart_busy") > busy_before + 10

    await eventually(restarts_told_busy, timeout=30)
    in_hand = (
        "SELECT count(*) FROM instance_manager.sagas WHERE kind = 'instance-start' AND status = 'running'"
    )
    assert await db.fetchval(in_hand) <= 3

    restart_service(stack, "accounting")
    mine = "SELECT count(*) FROM instance_manager.instances WHERE name = any($1) AND state = 'running'"

    async def all_back() -> bool:
        return await db.fetchval(mine, names) == len(names)

    await eventually(all_back, timeout=60)
    await assert_invariants(db)


async def test_a_pass_that_leaves_restarts_refused_busy_is_followed_at_once() -> None:
    """A pass of recovery's restarts asks a `busy` one again only for a reconcile interval, and leaves
    the rest to the next pass; that pass then follows at once, not an interval later: after a power loss
    the restarts would otherwise stall for an interval in every two while instance-manager, its backlog
    done, waits idle (seen at 5,000 sleds: restarts at 0.6x the fresh starts, in bursts). Here
    instance-manager is stopped and an identity of its kind answers every restart `busy`."""
    async with private_rack("busy-pass", RACKPLANE_SLEDS="1") as (stack, _, _db):
        stack.services["instance_manager"].stop()
        stack.services["recovery"].stop()  # its own passes would ask the same restarts beside this one
        asked: list[uuid.UUID] = []

        async def busy(body: InstanceRestart, msg: Msg) -> dict[str, Any]:
            asked.append(body.instance_id)
            raise bus.CommandError("busy", "busy: retry after 50 ms (3 sagas in hand, 25 finished a second)")

        im, nc = await connect_as(stack, "instance-manager"), await connect_as(stack, "recovery")
        pool = await asyncpg.create_pool(stack.service_database_urls["recovery"], min_size=1, max_size=2)
        try:
            await bus.serve(im, subjects.command_pattern("instance"), {InstanceRestart: busy}, queue="im")
            await im.flush()
            ids = [uuid.uuid4() for _ in range(4)]
            await pool.executemany(  # recovery's picture: four instances failed, to be restarted
                "INSERT INTO recovery.instances (id, silo, project, name, state, generation, auto_restart, "
                "intended_state, failed_at) VALUES ($1, 's', 'p', $2, 'failed', 3, 'best_effort', "
                "'running', now())",
                [(i, f"vm-{n}") for n, i in enumerate(ids)],
            )
            reconciler = Reconciler(pool, nc, stack.database_url, interval=0.5)
            started = time.monotonic()
            done = await reconciler.bring_back()
            assert time.monotonic() - started < 2, "a pass asks for about an interval, then leaves the rest"
            assert done == {"restart": 4, "settle": 0, "cooling_down": 0, "deferred": 4}, done
            assert reconciler.wake_restarts.is_set(), "the next pass is not woken: it would wait an interval"
            assert set(asked) == set(ids) and len(asked) > len(ids), "each was asked again after 50 ms"
        finally:
            await pool.close()
            await im.close()
            await nc.close()
