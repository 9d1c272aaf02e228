"""The transactional outbox: a message that follows a database change is written in the change's own
transaction (`enqueue`), and a relay publishes committed rows to JetStream, then deletes them."""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path

import asyncpg
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from opentelemetry.semconv._incubating.attributes.messaging_attributes import (
    MESSAGING_BATCH_MESSAGE_COUNT,
    MESSAGING_MESSAGE_ID,
    MessagingOperationTypeValues,
)
from opentelemetry.trace import SpanKind

from shared import metrics, telemetry
from shared.bus import MSG_ID, BulkPublisher, msg_id_for
from shared.bus.consume import small
from shared.db.queries import queries
from shared.messages import Model, encode_envelope
from shared.waits import woken

log = logging.getLogger(__name__)

OUTBOX = Path(__file__).parent / "outbox.sql"
ACK_TIMEOUT = 10.0
"""How long the relay waits for JetStream to ack what it published, before it tries again."""


async def enqueue(
    conn: asyncpg.Connection, subject: str, body: Model, *, source: str, key: str | None = None
) -> None:
    """Write a message to publish once the caller's transaction commits. `key` makes its id stable.

    Its `create` span (PRODUCER) is the context the message carries: the consumer's span is its child."""
    msg_id = msg_id_for(key) if key else uuid.uuid4()
    with telemetry.messaging_span(
        subject,
        MessagingOperationTypeValues.CREATE,
        SpanKind.PRODUCER,
        **{MESSAGING_MESSAGE_ID: str(msg_id)},
    ):
        await conn.execute(
            queries(OUTBOX)["enqueue"],
            msg_id,
            subject,
            encode_envelope(body, source, msg_id),
            telemetry.inject({MSG_ID: str(msg_id)}),
        )


async def enqueue_many(
    conn: asyncpg.Connection, messages: list[tuple[str, Model, str | None]], *, source: str
) -> None:
    """`enqueue` for many (subject, body, key) at once, in their order, in one statement. They share the
    caller's trace context, so their headers are made once (the relay adds each one's message id)."""
    if not messages:
        return
    ids = [msg_id_for(key) if key else uuid.uuid4() for _, _, key in messages]
    with telemetry.messaging_span(
        messages[0][0],
        MessagingOperationTypeValues.CREATE,
        SpanKind.PRODUCER,
        **{MESSAGING_BATCH_MESSAGE_COUNT: len(messages)},
    ):
        await conn.execute(
            queries(OUTBOX)["enqueue_many"],
            ids,
            [subject for subject, _, _ in messages],
            [encode_envelope(body, source, i) for (_, body, _), i in zip(messages, ids, strict=True)],
            telemetry.inject({}),
        )


class OutboxRelay:
    """Publishes committed outbox rows to JetStream in order, then deletes them.

    A row is deleted only after JetStream acknowledged it; a crash in between publishes it again with the
    same Nats-Msg-Id, which the broker drops as a duplicate inside its window (and consumers are
    idempotent beyond it). "In order" holds per relay: two replicas' relays share an outbox (SKIP LOCKED)
    and may interleave their rows, so consumers never rely on order across a service's replicas.
    """

    def __init__(
        self, pool: asyncpg.Pool, nc: NATS, js: JetStreamContext, *, batch: int = 1000, linger: float = 0.0
    ) -> None:
        self.pool = pool
        self.js = js
        self.publisher = BulkPublisher(nc)
        self.batch = batch
        self.linger = linger
        """Seconds to wait before the next round when rows were committed while a round of less than a
        quarter of `batch` published: under load they gather meanwhile, and a round (a transaction, a
        claim, a delete, the acks) serves more of them. A round that was not kicked meanwhile waits for
        the next kick, which it answers at once: a lone message is never held. The service's
        RACKPLANE_BATCH_LINGER (the consumers' rule: `bus.Consumer.linger`)."""
        self.wake = asyncio.Event()
        metrics.sampler(self.sample_depth)

    async def sample_depth(self) -> None:
        """The outbox's depth (rows committed, not yet published), for /metrics and stats."""
        metrics.gauge("outbox.depth", await self.pool.fetchval(queries(OUTBOX)["pending"]))

    def kick(self) -> None:
        self.wake.set()

    async def run(self) -> None:
        """Publish what is committed, round after round. A kick that comes while a round publishes is kept
        (the wake is cleared before the round claims its rows), so its rows go out in the next round."""
        while True:
            self.wake.clear()
            try:
                sent = await self.drain_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("outbox relay: %s; retrying", e)
                telemetry.count("outbox.errors")
                sent = 0
                await asyncio.sleep(0.5)
            if sent < self.batch:
                if self.linger and 0 < sent and small(sent, self.batch) and self.wake.is_set():  # company
                    await asyncio.sleep(self.linger)  # more rows gather meanwhile
                await woken(self.wake, 0.05)

    async def drain_once(self) -> int:
        q = queries(OUTBOX)
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(q["claim"], self.batch)
            if not rows:
                return 0
            await self._publish(
                [(r["subject"], r["payload"], {**r["headers"], MSG_ID: str(r["msg_id"])}) for r in rows]
            )
            await conn.execute(q["delete"], [r["seq"] for r in rows])
        telemetry.count("outbox.published", len(rows))
        return len(rows)

    async def _publish(self, messages: list[tuple[str, bytes, dict[str, str]]]) -> None:
        """Publish the rows and wait for every ack (fault injection may delay, copy, reorder or refuse them:
        the rows stay until their acks, so a refused or lost publish is sent again by a later drain)."""
        await self.publisher.publish(messages, timeout=ACK_TIMEOUT)
