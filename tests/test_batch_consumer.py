"""The batch consumer (shared/bus/consume.py): a poison message in a batch is dead-lettered alone, with the
reason, and the rest of its batch applies; refusals per message; acks only after the handler returned.
And its other half, the bulk publisher the outbox relay uses: every message stored, or an error.

On a bare nats-server of its own with rackplane's streams, so that the handler can be anything.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats
import nats.js.errors
import pytest

from shared import bus, metrics
from shared.db import OutboxRelay
from shared.messages import ProvisionDelta, SledInventory, VmmReport
from shared.topology import subjects
from tests.conftest import bare_jetstream, eventually

SILO_ID, PROJECT_ID = uuid.uuid4(), uuid.uuid4()


@pytest.fixture
async def js() -> AsyncIterator[Any]:
    async with bare_jetstream("batch") as made:
        yield made


def delta(generation: int) -> ProvisionDelta:
    return ProvisionDelta(
        instance_id=uuid.uuid4(), project_id=PROJECT_ID, silo_id=SILO_ID, generation=generation,
        vcpus=1, ram_bytes=0, disk_bytes=0,
    )  # fmt: skip


async def publish_delta(js: Any, generation: int) -> None:
    """A delta of `generation`, of an instance of its own."""
    d = delta(generation)
    await bus.publish(js, subjects.provision_delta("s", "p", d.instance_id), d, source="test")


async def publish_deltas(js: Any, n: int) -> None:
    """Deltas of generations 1 to n, each of its own instance."""
    for g in range(1, n + 1):
        await publish_delta(js, g)


def deltas_consumer(js: Any, durable: str, handler: bus.BatchHandler, **kw: Any) -> bus.Consumer:
    return bus.Consumer(
        js, service="test", stream=subjects.PROVISION_STREAM, durable=durable,
        filter_subject="rp.acct.part.>", batch_handler=handler, expect=ProvisionDelta, **kw,
    )  # fmt: skip


async def test_a_poison_message_is_dead_lettered_alone_and_its_batch_applies(js: Any) -> None:
    applied: list[int] = []
    batches: list[int] = []

    async def handler(batch: list[bus.Delivery]) -> None:
        batches.append(len(batch))
        if any(d.body.generation == 13 for d in batch):
            raise ValueError("generation 13 breaks the handler")
        for d in batch:
            if d.body.generation == 7:
                d.refused = bus.Reject("seven is refused")
            else:
                applied.append(d.body.generation)

    await publish_deltas(js, 40)
    consumer = deltas_consumer(js, "test-batches", handler, max_deliver=2, dead_letters="test-deltas")
    task = asyncio.create_task(consumer.run())
    try:

        async def parked() -> list[Any]:
            sub = await js.subscribe(subjects.dead_letter("test", "test-deltas"), ordered_consumer=True)
            out = []
            try:
                while True:
                    out.append(await sub.next_msg(timeout=0.3))
            except nats.errors.TimeoutError:
                pass
            finally:
                await sub.unsubscribe()
            return out if len(out) == 2 else []

        letters = await eventually(parked, timeout=20)
        assert sorted(applied) == [g for g in range(1, 41) if g not in (7, 13)]
        reasons = sorted(m.headers["Rp-Dlq-Reason"] for m in letters)
        assert reasons[0].startswith("handler failed 2 times: ValueError: generation 13 breaks the handler")
        assert reasons[1] == "seven is refused"
        assert max(batches) > 1  # they came in batches, and the failing one was split down to the poison
        assert batches.count(1) >= 2
        info = await js.consumer_info(subjects.PROVISION_STREAM, "test-batches")
        assert info.num_ack_pending == 0 and info.num_pending == 0
    finally:
        task.cancel()


async def test_caught_up_is_clear_while_a_backlog_waits_and_set_once_it_is_applied(js: Any) -> None:
    """What instance-manager's lost orders wait on (App.inventories_first): clear while the broker holds
    more than the batch in hand, set once everything stored has been applied."""
    caught_up = asyncio.Event()
    caught_up.set()
    seen: list[tuple[int, bool]] = []

    async def handler(batch: list[bus.Delivery]) -> None:
        seen.append((len(batch), caught_up.is_set()))

    await publish_deltas(js, 25)
    consumer = deltas_consumer(js, "test-caught-up", handler, batch=10, caught_up=caught_up)
    task = asyncio.create_task(consumer.run())
    try:

        async def applied() -> bool:
            return sum(n for n, _ in seen) == 25 and caught_up.is_set()

        await eventually(applied, timeout=10)
        assert [n for n, _ in seen] == [10, 10, 5]
        assert [was_set for _, was_set in seen] == [False, False, False]  # the last batch: set once applied
    finally:
        task.cancel()


async def test_a_consumer_that_says_when_it_caught_up_lingers_too_and_is_caught_up_meanwhile(js: Any) -> None:
    """Instance-manager's inventories and reports linger like any batch consumer (5,000 sleds' inventories
    come a few at a time), and its lost and stuck orders wait on their `caught_up`. A batch that lingers
    had nothing stored behind it: the consumer is caught up while it lingers, so that a steady trickle
    never keeps those orders waiting; what comes meanwhile is applied as one batch after the linger."""
    linger = 0.8
    caught_up = asyncio.Event()
    batches: list[list[int]] = []
    during: list[bool] = []
    loop = asyncio.get_running_loop()

    async def handler(batch: list[bus.Delivery]) -> None:
        batches.append([d.body.generation for d in batch])

    async def applied(n: int) -> bool:
        return sum(len(b) for b in batches) == n

    await publish_deltas(js, 3)  # stored before anyone fetches: they come as one batch, which lingers
    consumer = deltas_consumer(js, "test-linger-caught-up", handler, linger=linger, caught_up=caught_up)
    task = asyncio.create_task(consumer.run())
    try:
        await eventually(lambda: applied(3), timeout=5)
        first = loop.time()
        for g in range(4, 8):  # while it lingers, four more come one by one
            await publish_delta(js, g)
            await asyncio.sleep(linger / 20)
            during.append(caught_up.is_set())
        await eventually(lambda: applied(7), timeout=5)
        assert batches == [[1, 2, 3], [4, 5, 6, 7]]  # the four in one batch, after the linger
        assert loop.time() - first >= linger * 0.9
        assert all(during)  # no backlog behind the batch that lingered: its waiters need not wait
    finally:
        task.cancel()


async def test_every_stream_can_hold_a_consumer_for_each_sled_of_a_full_rack(js: Any) -> None:
    """A stream that sets no limit of its own holds at most 1,000 consumers (nats-server 2.15), and the
    sleds' command stream holds one durable consumer a sled: a rack of 5,000 needs more."""
    for name in subjects.STREAMS:
        assert (await js.stream_info(name)).config.max_consumers >= 5000, name


async def test_an_inventory_is_kept_for_its_ttl_and_a_vmm_report_beside_it_stays(js: Any) -> None:
    """Inventories are posted with a TTL (services/sled_agent: `Settings.inventory_keep()`), which the
    sleds' report stream honours: the week that VMM reports are kept would be some 600 million inventories
    at 5,000 sleds every 5 s, each superseded by the next."""
    assert (await js.stream_info(subjects.SLED_REPORT_STREAM)).config.allow_msg_ttl
    boot = uuid.uuid4()
    inventory = SledInventory(
        sled_id="sled-0", boot_id=boot, boot_number=1, seq=1, vcpus=8, ram_bytes=2**34, vmms=[]
    )
    report = VmmReport(
        sled_id="sled-0", boot_id=boot, boot_number=1, seq=2, vmm_id=uuid.uuid4(),
        instance_id=uuid.uuid4(), state="running", generation=1,
    )  # fmt: skip
    inventory_subject = subjects.sled_report("sled-0", "inventory")
    await bus.publish(js, inventory_subject, inventory, source="test", ttl=2, acked=False)
    await bus.publish(js, subjects.sled_report("sled-0", "vmm"), report, source="test")

    async def stored() -> bool:
        try:
            return bool(await js.get_last_msg(subjects.SLED_REPORT_STREAM, inventory_subject))
        except nats.js.errors.NotFoundError:
            return False

    await eventually(stored, timeout=5)
    held = await js.get_last_msg(subjects.SLED_REPORT_STREAM, inventory_subject)
    assert held.headers and held.headers[bus.TTL_HEADER] == "2s"

    async def gone() -> bool:
        return not await stored()

    await eventually(gone, timeout=15)  # the inventory went; the report stays
    kept = await js.get_last_msg(subjects.SLED_REPORT_STREAM, subjects.sled_report("sled-0", "vmm"))
    assert kept.headers and bus.TTL_HEADER not in kept.headers


def test_message_ids_are_the_uuid5_of_their_keys() -> None:
    """Ids derived from keys must not change between releases: a resend after an upgrade is dropped by the
    broker only if its id is the one the older release gave the message."""
    for key in ("outcome:5b1c...:3", "", "ü"):
        assert bus.msg_id_for(key) == uuid.uuid5(uuid.NAMESPACE_URL, f"rackplane:{key}")


async def test_bulk_publish_stores_every_message_once(js: Any) -> None:
    nc = js._nc
    publisher = bus.BulkPublisher(nc)
    subject = subjects.event("s", "provision", "outcome")
    ids = [str(uuid.uuid4()) for _ in range(300)]
    before = (await js.stream_info(subjects.EVENTS_STREAM)).state.messages
    await publisher.publish([(subject, b"x", {bus.MSG_ID: i}) for i in ids], timeout=5)
    # again, with new ones after: the repeats are acked as duplicates and stored once
    more = [str(uuid.uuid4()) for _ in range(10)]
    await publisher.publish([(subject, b"x", {bus.MSG_ID: i}) for i in ids + more], timeout=5)
    assert (await js.stream_info(subjects.EVENTS_STREAM)).state.messages == before + 310


async def test_bulk_publish_says_what_no_stream_takes(js: Any) -> None:
    publisher = bus.BulkPublisher(js._nc)
    with pytest.raises(bus.PublishFailed, match=r"rp\.nowhere\.at\.all: no stream takes"):
        await publisher.publish([("rp.nowhere.at.all", b"x", {bus.MSG_ID: "1"})], timeout=5)
    # the publisher goes on: the next round is not confused by the last one's answers
    await publisher.publish([(subjects.event("s", "provision", "outcome"), b"x", {})], timeout=5)


async def test_bulk_publish_gives_up_on_a_round_and_its_late_acks_change_nothing(js: Any) -> None:
    publisher = bus.BulkPublisher(js._nc)
    subject = subjects.event("s", "provision", "outcome")
    before = (await js.stream_info(subjects.EVENTS_STREAM)).state.messages
    with pytest.raises(bus.PublishFailed, match="not acked"):
        await publisher.publish([(subject, b"x", {}) for _ in range(500)], timeout=0)
    # its 500 acks come while the next round waits: they must not count as the next round's
    await publisher.publish([(subject, b"y", {bus.MSG_ID: str(uuid.uuid4())})], timeout=5)
    assert (await js.stream_info(subjects.EVENTS_STREAM)).state.messages == before + 501


async def test_a_batch_that_found_company_lingers_and_a_lone_message_is_never_held(js: Any) -> None:
    """RACKPLANE_BATCH_LINGER: after a batch of more than one message, the next fetch waits out the linger,
    so that what comes meanwhile is applied as one batch; a message that comes alone is applied at once,
    and so is the one after it."""
    linger = 0.8
    batches: list[tuple[float, list[int]]] = []
    loop = asyncio.get_running_loop()

    async def handler(batch: list[bus.Delivery]) -> None:
        batches.append((loop.time(), [d.body.generation for d in batch]))

    def applied(n: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return sum(len(b) for _, b in batches) == n

        return check

    async def publish(generation: int) -> float:
        await publish_delta(js, generation)
        return loop.time()

    await publish_deltas(js, 3)  # stored before anyone fetches: the first fetch brings them together
    task = asyncio.create_task(deltas_consumer(js, "test-linger", handler, linger=linger).run())
    try:
        await eventually(applied(3), timeout=5)
        for g in range(4, 8):  # while it lingers, four more come one by one
            await publish(g)
            await asyncio.sleep(linger / 20)
        await eventually(applied(7), timeout=5)
        assert [b for _, b in batches] == [[1, 2, 3], [4, 5, 6, 7]]  # the four in one batch
        assert batches[1][0] - batches[0][0] >= linger * 0.9  # after the linger

        await asyncio.sleep(linger * 1.5)  # the linger after the four is over: the consumer waits
        for g in (8, 9):  # alone: each applied at once, the one after it too
            sent = await publish(g)
            await eventually(applied(g), timeout=5)
            assert batches[-1][1] == [g]
            assert batches[-1][0] - sent < linger / 2
    finally:
        task.cancel()


@pytest.mark.parametrize("linger", [0.5, 0.0])
async def test_the_relay_keeps_a_kick_that_comes_while_it_publishes_and_lingers_after_it(
    js: Any, linger: float
) -> None:
    """The outbox relay's rounds (OutboxRelay.run): rows committed while a round publishes (a kick during
    it) are not forgotten: the next round takes them, after the linger (so that more gather meanwhile),
    or at once without one, not at the relay's next idle poll (50 ms later)."""
    loop = asyncio.get_running_loop()
    rounds: list[float] = []

    class Relay(OutboxRelay):
        async def drain_once(self) -> int:  # the rounds' timing alone: no database
            rounds.append(loop.time())
            if len(rounds) == 1:
                self.kick()  # a commit while the first round publishes
                return 2
            return 0

    relay = Relay(None, js._nc, js, linger=linger)  # type: ignore[arg-type]
    metrics._samplers.remove(relay.sample_depth)  # it has no database to sample
    task = asyncio.create_task(relay.run())
    try:
        await eventually(lambda: _true(len(rounds) >= 2), timeout=5)
        if linger:
            assert rounds[1] - rounds[0] >= linger * 0.9
        else:
            assert rounds[1] - rounds[0] < 0.04
    finally:
        task.cancel()


async def _true(value: bool) -> bool:
    return value
