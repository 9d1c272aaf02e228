"""The broker and the database restart under a running control plane: nothing is lost or counted twice,
and everything in flight converges once they are back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from deploy.stack import Stack
from shared.bus import CommandError
from tests.conftest import GiB, Rack, assert_invariants, private_rack, unique, usage_is, wait_state


@pytest.fixture
async def rack() -> AsyncIterator[Rack]:
    async with private_rack("restarts", RACKPLANE_SLEDS="3") as made:
        yield made


async def retrying(call: Callable[[], object], timeout: float = 30) -> object:
    """An operator retries a command that failed while a dependency was down (commands are idempotent)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await call()  # type: ignore[misc]
        except CommandError as e:
            if e.code not in ("timeout", "unavailable") or asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.5)


async def run_through(rack: Rack, restart: Callable[[Stack], None]) -> None:
    stack, client, db = rack
    silo, proj = unique("silo"), unique("proj")
    await client.silo_create(silo)
    await client.project_create(silo, proj)
    names = [f"vm-{i}" for i in range(10)]
    for n in names:
        await client.instance_create(silo, proj, n, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    for n in names[:5]:
        await client.instance("start", silo, proj, n)

    starts = asyncio.gather(
        *(retrying(lambda n=n: client.instance("start", silo, proj, n)) for n in names[5:]),
        return_exceptions=True,
    )
    await asyncio.sleep(0.05)
    await asyncio.get_running_loop().run_in_executor(None, restart, stack)
    await starts
    for n in names:
        await wait_state(client, silo, proj, n, "running", timeout=60)
    for n in names[:5]:
        await retrying(lambda n=n: client.instance("stop", silo, proj, n))
    for n in names[:5]:
        await wait_state(client, silo, proj, n, "stopped", timeout=30)
    await usage_is(client, {"vcpus": 5, "ram_bytes": 5 * GiB, "disk_bytes": 10 * GiB}, silo)
    await assert_invariants(db, timeout=30)


def restart_broker(stack: Stack) -> None:
    assert stack.nats is not None
    stack.nats.stop()
    stack.nats.start()  # same port, same JetStream store


def restart_database(stack: Stack) -> None:
    assert stack.postgres is not None
    stack.postgres.stop("immediate")  # as a crash would: no shutdown checkpoint
    stack.postgres.start()


async def test_a_broker_restart_mid_run_loses_and_double_counts_nothing(rack: Rack) -> None:
    await run_through(rack, restart_broker)


async def test_a_database_restart_mid_run_loses_and_double_counts_nothing(rack: Rack) -> None:
    stack, _, _ = rack
    await run_through(rack, restart_database)
    assert all(svc.alive for svc in stack.services.values())


async def test_a_command_while_the_database_is_down_is_answered_unavailable(rack: Rack) -> None:
    stack, client, _ = rack
    assert stack.postgres is not None
    stack.postgres.stop("immediate")
    timeout, client.timeout = client.timeout, 3  # the client sends it again until its timeout, then says why
    try:
        with pytest.raises(CommandError) as e:
            await client.silo_create(unique("silo"))
        assert e.value.code == "unavailable", e.value
        assert "cannot reach its database or broker right now" in e.value.message
        assert e.value.message.endswith("; try again")
    finally:
        client.timeout = timeout
        stack.postgres.start()
    await retrying(lambda: client.silo_create(unique("silo")))
    assert all(svc.alive for svc in stack.services.values())
