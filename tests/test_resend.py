"""A command whose reply was lost is sent again by rackctl's client, with the same envelope id, and takes
effect once: the copy gets the first's answer (or awaits the first's saga), never a second instance, saga,
migration or charge, nor `conflict`/`not_found` about what the first did.

The first reply is lost by fault injection (instance-manager drops the replies on one subject) until the
test has seen it dropped; the client's next send is answered."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import asyncpg
import pytest

from deploy.stack import Stack
from rackctl.client import NO_SERVICE_FOR, Client
from shared import bus
from shared.messages import (
    InstanceCreate,
    PoolDelete,
    PoolResize,
    PoolShow,
    RequestFault,
    ServiceFaults,
    SiloLimitsSet,
    StatsGet,
)
from shared.topology import subjects
from tests.conftest import (
    GiB,
    assert_invariants,
    counter,
    eventually,
    new_project,
    unique,
    usage_is,
    wait_state,
)
from tests.test_cli import assert_ok
from tests.test_observability import fetch
from tests.test_usage_audit import audit

SHAPE = {"vcpus": 1, "ram_bytes": GiB, "disk_bytes": 2 * GiB}
IM = "instance-manager"
COPIES = 8


@pytest.fixture
async def resender(stack: Stack) -> AsyncIterator[Client]:
    """A client whose sends each wait 0.5 s for their reply, within 30 s in all."""
    c = await Client.connect(stack.nats_url, timeout=30)
    c.attempt_share = 0.5 / 30
    yield c
    await c.close()


async def reply_lost(client: Client, subject: str, send: Awaitable[Any]) -> Any:
    """`send`'s reply, its first reply dropped by instance-manager (the faults cleared once it was)."""
    before = await counter(client, IM, "faults.drop_reply")
    await client.faults(IM, ServiceFaults(requests=RequestFault(drop_reply_probability=1), only=[subject]))
    try:
        sent = asyncio.ensure_future(send)

        async def dropped() -> bool:
            if sent.done():  # answered after all: the test below says how
                return True
            return await counter(client, IM, "faults.drop_reply") > before

        await eventually(dropped, timeout=20)
    finally:
        await client.faults(IM, ServiceFaults(clear=True))
    answer = await sent
    assert await counter(client, IM, "faults.drop_reply") > before, "no reply was lost"
    return answer


async def sagas(db: asyncpg.Pool, kind: str, instance_id: str) -> int:
    return await db.fetchval(  # type: ignore[no-any-return]
        "SELECT count(*) FROM instance_manager.sagas WHERE kind = $1 AND params->>'instance_id' = $2",
        kind,
        instance_id,
    )


async def instances_named(db: asyncpg.Pool, silo: str, proj: str, name: str) -> int:
    return await db.fetchval(  # type: ignore[no-any-return]
        "SELECT count(*) FROM instance_manager.instances i"
        " JOIN instance_manager.projects p ON p.id = i.project_id"
        " JOIN instance_manager.silos s ON s.id = p.silo_id"
        " WHERE s.name = $1 AND s.deleted_at IS NULL AND p.name = $2 AND p.deleted_at IS NULL"
        " AND i.name = $3",
        silo,
        proj,
        name,
    )


async def clean(stack: Stack, db: asyncpg.Pool, silo: str) -> None:
    await assert_invariants(db)
    assert_ok(await audit(stack, silo, "--settle", "20"))


async def test_a_create_whose_reply_was_lost_is_sent_again_and_creates_once(
    stack: Stack, client: Client, resender: Client, db: asyncpg.Pool, capsys: pytest.CaptureFixture[str]
) -> None:
    silo, proj = await new_project(client, "resend")
    subject = subjects.command(silo, "instance", "create")
    v = await reply_lost(client, subject, resender.instance_create(silo, proj, "vm", **SHAPE))
    assert v["name"] == "vm" and v["state"] == "stopped", v
    assert resender.resent == 1
    said = [line for line in capsys.readouterr().err.splitlines() if "sending it again" in line]
    assert len(said) == 1 and subject in said[0], said  # once, naming what and why
    assert await instances_named(db, silo, proj, "vm") == 1
    assert await sagas(db, "instance-create", v["id"]) == 1
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 2 * GiB}, silo, proj)
    await clean(stack, db, silo)


async def test_a_start_whose_reply_was_lost_is_sent_again_and_starts_once(
    stack: Stack, client: Client, resender: Client, db: asyncpg.Pool
) -> None:
    silo, proj = await new_project(client, "resend")
    made = await client.instance_create(silo, proj, "vm", **SHAPE)
    subject = subjects.command(silo, "instance", "start")
    v = await reply_lost(client, subject, resender.instance("start", silo, proj, "vm"))
    assert v["state"] in ("starting", "running"), v
    await wait_state(client, silo, proj, "vm", "running")
    assert await sagas(db, "instance-start", made["id"]) == 1
    await usage_is(client, {"vcpus": 1, "ram_bytes": GiB, "disk_bytes": 2 * GiB}, silo, proj)
    await clean(stack, db, silo)


async def test_a_stop_whose_reply_was_lost_gets_the_first_answer(
    stack: Stack, client: Client, resender: Client, db: asyncpg.Pool
) -> None:
    silo, proj = await new_project(client, "resend")
    await client.instance_create(silo, proj, "vm", **SHAPE)
    running = await client.instance("start", silo, proj, "vm")
    await wait_state(client, silo, proj, "vm", "running")
    subject = subjects.command(silo, "instance", "stop")
    v = await reply_lost(client, subject, resender.instance("stop", silo, proj, "vm"))
    await wait_state(client, silo, proj, "vm", "stopped")
    # the answer the stop got when it was applied, not the instance as the copy finds it (stopped)
    assert v["state"] == "stopping" and v["generation"] > running["generation"], v
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 2 * GiB}, silo, proj)
    await clean(stack, db, silo)


async def test_a_migration_whose_reply_was_lost_moves_the_instance_once(
    stack: Stack, client: Client, resender: Client, db: asyncpg.Pool
) -> None:
    silo, proj = await new_project(client, "resend")
    made = await client.instance_create(silo, proj, "vm", **SHAPE)
    await client.instance("start", silo, proj, "vm")
    before = await wait_state(client, silo, proj, "vm", "running")
    subject = subjects.command(silo, "instance", "migrate")
    v = await reply_lost(client, subject, resender.instance_migrate(silo, proj, "vm"))
    moved = v["migration"]
    assert moved["source_sled_id"] == before["sled_id"] != moved["target_sled_id"], v
    # the move ended where the first migration took it
    await eventually(lambda: _on(client, silo, proj, moved["target_sled_id"]), timeout=20)
    assert await sagas(db, "instance-migrate", made["id"]) == 1
    await usage_is(client, {"vcpus": 1, "ram_bytes": GiB, "disk_bytes": 2 * GiB}, silo, proj)
    await clean(stack, db, silo)


async def _on(client: Client, silo: str, proj: str, sled: str) -> bool:
    v = await client.instance("show", silo, proj, "vm")
    return bool(v["state"] == "running" and v["sled_id"] == sled and v["target_vmm_id"] is None)


async def test_a_delete_whose_reply_was_lost_gets_the_first_answer(
    stack: Stack, client: Client, resender: Client, db: asyncpg.Pool
) -> None:
    silo, proj = await new_project(client, "resend")
    made = await client.instance_create(silo, proj, "vm", **SHAPE)
    subject = subjects.command(silo, "instance", "delete")
    v = await reply_lost(client, subject, resender.instance("delete", silo, proj, "vm"))
    assert v["id"] == made["id"] and v["state"] == "destroyed", v  # not `not_found`
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 0}, silo, proj)
    await clean(stack, db, silo)


async def test_silo_and_project_creates_and_deletes_whose_replies_were_lost_apply_once(
    stack: Stack, client: Client, resender: Client, db: asyncpg.Pool
) -> None:
    silo, proj = unique("resend"), unique("proj")
    fleet = subjects.command(None, "silo", "create")
    s = await reply_lost(client, fleet, resender.silo_create(silo))  # not `conflict: already exists`
    p = await reply_lost(
        client, subjects.command(silo, "project", "create"), resender.project_create(silo, proj)
    )
    assert s["name"] == silo and p["name"] == proj and p["silo"] == silo
    assert (await client.silo_show(silo))["id"] == s["id"]
    assert [x["id"] for x in await client.project_list(silo)] == [p["id"]]
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 0}, silo, proj)
    gone = await reply_lost(
        client, subjects.command(silo, "project", "delete"), resender.project_delete(silo, proj)
    )
    assert gone["id"] == p["id"]  # not `not_found`
    gone = await reply_lost(client, subjects.command(None, "silo", "delete"), resender.silo_delete(silo))
    assert gone["id"] == s["id"]
    await assert_invariants(db)


async def test_a_pick_from_a_pool_whose_reply_was_lost_hands_out_one_vm(
    stack: Stack, client: Client, resender: Client, db: asyncpg.Pool
) -> None:
    silo, proj = await new_project(client, "resend")
    await client.pool_create(silo, proj, "warm", size=1, **SHAPE)
    try:

        async def one_idle() -> bool:
            return bool((await client.pool("show", silo, proj, "warm"))["idle"] == 1)

        await eventually(one_idle, timeout=30)
        subject = subjects.command(silo, "instance", "create")
        v = await reply_lost(
            client, subject, resender.instance_from_pool(silo, proj, "mine", "warm", require=True)
        )
        assert v["source"] == "pool" and v["name"] == "mine", v  # not `conflict: already exists`
        handed_out = await db.fetchval(
            "SELECT count(*) FROM instance_manager.instances WHERE project_id = $1"
            " AND has_customer_data_at IS NOT NULL AND pool_id IS NOT NULL AND state <> 'destroyed'",
            uuid.UUID(v["project_id"]),
        )
        assert handed_out == 1
    finally:
        await client.pool("delete", silo, proj, "warm")
    await assert_invariants(db)


async def test_a_refusal_is_an_answer_and_is_not_sent_again(client: Client, resender: Client) -> None:
    silo, proj = await new_project(client, "resend")
    await client.instance_create(silo, proj, "vm", **SHAPE)
    with pytest.raises(bus.CommandError) as e:
        await resender.instance_create(silo, proj, "vm", **SHAPE)
    assert e.value.code in ("conflict", "refused") and "already exists" in e.value.message, e.value
    assert resender.resent == 0


async def test_two_copies_of_a_create_at_two_replicas_begin_one_saga(
    stack: Stack, client: Client, db: asyncpg.Pool
) -> None:
    """Copies of one create (one envelope id) sent at once, to two instance-manager replicas (the queue
    group spreads them): the first claims the id, the others wait for its commit and await its saga."""
    key = "instance-manager-2"
    stack.start_service("instance_manager", replica=key)
    try:
        await eventually(lambda: _ready(stack, key), timeout=30)
        silo, proj = await new_project(client, "resend")
        for attempt in range(3):  # until both replicas took part (each copy goes to either)
            name = f"vm-{attempt}"
            body = InstanceCreate(silo=silo, project=proj, name=name, **SHAPE)
            subject, request_id = subjects.command(silo, "instance", "create"), uuid.uuid4()
            copies = await asyncio.gather(
                *(
                    bus.request(client.nc, subject, body, source="test", timeout=20, request_id=request_id)
                    for _ in range(COPIES)
                )
            )
            assert {v["id"] for v in copies} == {copies[0]["id"]}, copies
            assert await instances_named(db, silo, proj, name) == 1
            assert await sagas(db, "instance-create", copies[0]["id"]) == 1
            answered = {k: _logged(stack, k, request_id) for k in ("instance_manager", key)}
            assert sum(answered.values()) == COPIES - 1, answered  # every copy but the one that claimed it
            ran = await db.fetchval(
                "SELECT e.owner FROM instance_manager.saga_events e JOIN instance_manager.sagas s"
                " ON s.id = e.saga_id WHERE s.params->>'instance_id' = $1 AND e.step = 'record'",
                copies[0]["id"],
            )
            claimed = {k for k in answered if f":{stack.services[k].proc.pid}:" in ran}  # type: ignore[union-attr]
            if len({k for k, n in answered.items() if n} | claimed) == 2:
                break
        else:
            pytest.fail("every copy went to one replica, three times")
        # the same id for another command is refused, not answered with this one's reply
        other = body.model_copy(update={"name": "other"})
        with pytest.raises(bus.CommandError) as e:
            await bus.request(client.nc, subject, other, source="test", timeout=20, request_id=request_id)
        assert e.value.code == "invalid", e.value
        n = attempt + 1
        await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": n * 2 * GiB}, silo, proj)
    finally:
        stack.services.pop(key).stop()
        stack.http_ports.pop(key, None)
        stack.write_manifest()
    await clean(stack, db, silo)


def _logged(stack: Stack, key: str, request_id: uuid.UUID) -> int:
    """How many copies of the request this process answered from the first's record (its log says)."""
    text = (stack.dir / f"{key}.log").read_text(errors="replace")
    return sum(f"request {request_id} came again" in line for line in text.splitlines())


async def _ready(stack: Stack, key: str) -> bool:
    try:
        status, _ = await fetch(stack, key, "/readyz")
    except OSError:
        return False
    return status == 200


async def test_a_resize_or_limits_sent_again_does_not_undo_a_later_change(
    client: Client, db: asyncpg.Pool, stack: Stack
) -> None:
    """A copy of a resize (or of a silo's limits) arriving after another caller changed them again, as a
    resend whose first reply was lost does: answered as the first was, and the later change stands."""
    silo, proj = await new_project(client, "resend")
    await client.pool_create(silo, proj, "warm", size=0, **SHAPE)
    resize = subjects.command(silo, "pool", "resize")
    first, later = uuid.uuid4(), uuid.uuid4()
    answer = await bus.request(
        client.nc,
        resize,
        PoolResize(silo=silo, project=proj, name="warm", size=1),
        source="test",
        request_id=first,
    )
    await bus.request(
        client.nc,
        resize,
        PoolResize(silo=silo, project=proj, name="warm", size=0),
        source="test",
        request_id=later,
    )
    again = await bus.request(
        client.nc,
        resize,
        PoolResize(silo=silo, project=proj, name="warm", size=1),
        source="test",
        request_id=first,
    )
    assert again == answer
    shown = await client.call(
        subjects.command(silo, "pool", "show"), PoolShow(silo=silo, project=proj, name="warm")
    )
    assert shown["target_size"] == 0, shown

    fleet, first, later = subjects.command(None, "silo", "limits"), uuid.uuid4(), uuid.uuid4()
    await bus.request(
        client.nc, fleet, SiloLimitsSet(name=silo, instances=5), source="test", request_id=first
    )
    await bus.request(
        client.nc, fleet, SiloLimitsSet(name=silo, instances=7), source="test", request_id=later
    )
    again = await bus.request(
        client.nc, fleet, SiloLimitsSet(name=silo, instances=5), source="test", request_id=first
    )
    assert again["limits"]["instances"] == 7, again
    await client.call(
        subjects.command(silo, "pool", "delete"), PoolDelete(silo=silo, project=proj, name="warm")
    )
    await clean(stack, db, silo)


async def test_a_command_no_service_answers_fails_within_seconds(stack: Stack) -> None:
    """No process subscribed (no stack, or a single process restarting): sent again for a few seconds
    (NO_SERVICE_FOR), then the one-line error, not after the client's whole timeout (rackctl's is 60 s)."""
    c = await Client.connect(stack.nats_url, timeout=60)
    try:
        started = time.monotonic()
        with pytest.raises(bus.CommandError) as e:
            await c.call(subjects.stats("no-such-service"), StatsGet())
        took = time.monotonic() - started
    finally:
        await c.close()
    assert e.value.code == "unavailable" and "no service answers" in e.value.message, e.value
    assert took < NO_SERVICE_FOR + 3, took  # not the client's 60 s
