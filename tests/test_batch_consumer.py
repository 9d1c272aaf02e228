"""The batch consumer (shared/bus.py): a poison message in a batch is dead-lettered alone, with the
reason, and the rest of its batch applies; refusals per message; acks only after the handler returned.

On a bare nats-server of its own with rackplane's streams, so that the handler can be anything.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest

from deploy.stack import Nats, free_port
from deploy.streams import ensure_streams
from shared import bus, subjects
from shared.messages import ProvisionDelta
from tests.conftest import eventually

SILO_ID, PROJECT_ID = uuid.uuid4(), uuid.uuid4()


@pytest.fixture
async def js() -> AsyncIterator[Any]:
    folder = Path(tempfile.mkdtemp(prefix="rackplane-batch-"))
    server = Nats(folder / "nats", port=free_port()).start()
    nc = await nats.connect(server.url)
    try:
        await ensure_streams(nc.jetstream())
        yield nc.jetstream()
    finally:
        await nc.close()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def delta(generation: int) -> ProvisionDelta:
    return ProvisionDelta(
        instance_id=uuid.uuid4(), project_id=PROJECT_ID, silo_id=SILO_ID, generation=generation,
        vcpus=1, ram_bytes=0, disk_bytes=0,
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

    for g in range(1, 41):
        d = delta(g)
        await bus.publish(js, subjects.provision_delta("s", "p", d.instance_id), d, source="test")
    consumer = bus.BatchConsumer(
        js, service="test", stream=subjects.PROVISION_STREAM, durable="test-batches",
        filter_subject="rp.acct.part.>", batch_handler=handler, expect=ProvisionDelta, max_deliver=2,
        dead_letters="test-deltas",
    )  # fmt: skip
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
