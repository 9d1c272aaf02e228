"""What a consumer's throughput rests on (docs/benchmarks.md, the accounting benchmark), kept honest:
a fetch is one pull request and one wait (`bus.Pull`), returning at once with what is there and waiting
only for a first message; a consumer whose durable is deleted makes it again; the outbox writes each
event as its envelope would (`encode_envelope`); and the NUL check runs on every field that can hold
text, a subclass's too, and on no other.

On a bare nats-server of its own with rackplane's streams, one for the module.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import pytest
from nats.js import api
from pydantic import ValidationError

from shared import bus, contract
from shared.messages import ProvisionDelta, decode, encode, encode_envelope, envelope, registry
from shared.messages.base import Model, read_body
from shared.topology import subjects
from tests.conftest import bare_jetstream, eventually

SILO_ID, PROJECT_ID = uuid.uuid4(), uuid.uuid4()


@pytest.fixture(scope="module")
async def js() -> AsyncIterator[Any]:
    async with bare_jetstream("pull") as made:
        yield made


async def publish_deltas(js: Any, generations: range) -> None:
    for g in generations:
        d = ProvisionDelta(
            instance_id=uuid.uuid4(), project_id=PROJECT_ID, silo_id=SILO_ID, generation=g,
            vcpus=1, ram_bytes=0, disk_bytes=0,
        )  # fmt: skip
        await bus.publish(js, subjects.provision_delta("s", "p", d.instance_id), d, source="test")


def consumer(js: Any, durable: str, handler: bus.BatchHandler) -> bus.Consumer:
    return bus.Consumer(
        js, service="test", stream=subjects.PROVISION_STREAM, durable=durable,
        filter_subject="rp.acct.part.>", batch_handler=handler, expect=ProvisionDelta,
    )  # fmt: skip


async def test_a_fetch_returns_at_once_with_what_is_there_and_waits_only_for_a_first_message(js: Any) -> None:
    await publish_deltas(js, range(1, 6))
    pull = await consumer(js, "test-pull", lambda batch: asyncio.sleep(0))._subscribe()
    try:
        t = time.perf_counter()
        msgs = await pull.fetch(100, timeout=5)
        assert len(msgs) == 5 and time.perf_counter() - t < 2  # not the batch's 100, not the 5 s
        for m in msgs:
            await m.ack()

        t = time.perf_counter()
        with pytest.raises(TimeoutError):
            await pull.fetch(100, timeout=0.3)
        assert 0.25 < time.perf_counter() - t < 2

        async def later() -> None:
            await asyncio.sleep(0.3)
            await publish_deltas(js, range(6, 7))

        publishing = asyncio.create_task(later())
        t = time.perf_counter()
        msgs = await pull.fetch(100, timeout=5)
        await publishing
        assert len(msgs) == 1 and time.perf_counter() - t < 3
        _, body = decode(msgs[0].data, ProvisionDelta)
        assert body.generation == 6  # type: ignore[attr-defined]
        await msgs[0].ack()
    finally:
        await pull.close()


async def test_a_consumer_whose_durable_is_deleted_makes_it_again_and_goes_on(js: Any) -> None:
    """The broker ends the pending pull with `409 Consumer Deleted` (a pull on a durable that is not
    there gets `503`): the consumer subscribes anew, which creates the durable again."""
    handled: set[int] = set()

    async def handler(batch: list[bus.Delivery]) -> None:
        handled.update(d.body.generation for d in batch)

    await js.purge_stream(subjects.PROVISION_STREAM)
    await publish_deltas(js, range(1, 11))
    task = asyncio.create_task(consumer(js, "test-deleted", handler).run())
    try:
        await eventually(lambda: asyncio.sleep(0, result=handled >= set(range(1, 11))), timeout=10)
        await js.delete_consumer(subjects.PROVISION_STREAM, "test-deleted")
        await publish_deltas(js, range(11, 21))
        await eventually(lambda: asyncio.sleep(0, result=handled >= set(range(1, 21))), timeout=20)
        info = await js.consumer_info(subjects.PROVISION_STREAM, "test-deleted")
        assert api.AckPolicy(info.config.ack_policy) == api.AckPolicy.EXPLICIT
        assert info.config.filter_subject == "rp.acct.part.>" and info.config.max_deliver == -1
    finally:
        task.cancel()


def test_the_outbox_writes_every_message_as_its_envelope_would() -> None:
    """`encode_envelope` skips building the envelope model; the bytes are `encode(envelope(...))`'s, but
    for the time each was made."""
    msg_id = uuid.uuid4()
    for (schema, version), model in sorted(registry().items()):
        body = read_body(model, contract.example(schema, version, model)["data"])
        fast, slow = encode_envelope(body, "test", msg_id), encode(envelope(body, "test", msg_id))
        a, b = json.loads(fast), json.loads(slow)
        assert list(a) == list(b) and a.pop("time") and b.pop("time"), schema
        assert a == b, schema
        assert fast.replace(json.dumps(json.loads(fast)["time"]).encode(), b"T") == slow.replace(
            json.dumps(json.loads(slow)["time"]).encode(), b"T"
        ), schema
        env, again = decode(fast)
        assert env.id == msg_id and again == body, schema


def storable_fields(model: type[Model]) -> tuple[str, ...]:
    return model.__pydantic_decorators__.field_validators["_storable"].info.fields


def test_the_nul_check_runs_on_every_field_that_can_hold_text_and_on_no_other() -> None:
    assert storable_fields(ProvisionDelta) == ()  # UUIDs and integers: nothing to check

    class Counts(Model):
        n: int
        at: uuid.UUID | None = None

    class Named(Counts):  # its parent checks nothing; what it adds is checked
        name: str
        tags: list[Annotated[str, "tag"]] = []
        by_key: dict[str, int] = {}
        anything: Any = None

    assert storable_fields(Counts) == ()
    assert set(storable_fields(Named)) == {"name", "tags", "by_key", "anything"}
    for bad in (
        {"name": "a\x00"},
        {"tags": ["ok", "b\x00"]},
        {"by_key": {"c\x00": 1}},
        {"anything": ["\x00"]},
    ):
        with pytest.raises(ValidationError) as refused:
            Named.model_validate({"n": 1, "name": "ok", **bad})
        assert "which no string may" in str(refused.value) and next(iter(bad)) in str(refused.value), bad
