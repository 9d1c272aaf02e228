"""Publishing: one envelope into JetStream (`publish`), with `Nats-Msg-Id` (the broker drops repeats
inside its window) and the trace context in headers; and many at once for the outbox relay
(`BulkPublisher`, one wait for all their acks)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import uuid
from contextlib import AbstractContextManager
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from opentelemetry.semconv._incubating.attributes.messaging_attributes import MESSAGING_MESSAGE_ID
from opentelemetry.semconv._incubating.attributes.messaging_attributes import (
    MessagingOperationTypeValues as Op,
)

from shared import telemetry
from shared.bus.errors import PublishFailed
from shared.bus.wire import WIRE, Bulk
from shared.messages import Envelope, Model, encode, envelope
from shared.waits import woken

MSG_ID = "Nats-Msg-Id"
TTL_HEADER = "Nats-TTL"
"""How long a stream that allows per-message TTLs keeps this message (`publish`'s `ttl`)."""

_MSG_ID_NAMESPACE = hashlib.sha1(uuid.NAMESPACE_URL.bytes + b"rackplane:")


def msg_id_for(key: str) -> uuid.UUID:
    """A message id derived from what the message means, so that a resend is recognisably the same:
    `uuid5(NAMESPACE_URL, "rackplane:" + key)`, from a hash already fed the namespace (an outbox batch
    makes a thousand of them)."""
    h = _MSG_ID_NAMESPACE.copy()
    h.update(key.encode())
    return uuid.UUID(bytes=h.digest()[:16], version=5)


def headers_for(env: Envelope) -> dict[str, str]:
    return telemetry.inject({MSG_ID: str(env.id)})


def wire_size(payload: bytes, headers: dict[str, str] | None = None) -> int:
    """What the broker counts against its max payload: the body and the headers block. nats-py checks the
    body alone, and the broker closes a connection that sends more (a protocol error: nats-py then
    closes it for good), so whatever forwards a body it did not make checks this first."""
    if not headers:
        return len(payload)
    block = b"NATS/1.0\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n"
    return len(payload) + len(block)


def _sending(subject: str, env: Envelope) -> AbstractContextManager[Any]:
    return telemetry.messaging_span(
        subject, Op.SEND, telemetry.SpanKind.PRODUCER, **{MESSAGING_MESSAGE_ID: str(env.id)}
    )


async def publish(
    js: JetStreamContext,
    subject: str,
    body: Model,
    *,
    source: str,
    key: str | None = None,
    ttl: float | None = None,
    acked: bool = True,
) -> api.PubAck | None:
    """Publish `body` in an envelope; with `acked`, return once JetStream stored it (its ack).

    `key`: what the message means, from which its id is made (`msg_id_for`), so that a resend is dropped
    as a repeat. `acked=False`: without waiting for the ack, for state that the next message of its kind
    supersedes (a sled's inventory), where a lost one costs nothing and a wait costs a future, a timer and
    a parsed ack per message (a third of a rack simulator's time). `ttl`: seconds the stream keeps it (its
    `Nats-TTL`; the stream must allow per-message TTLs)."""
    env = envelope(body, source, msg_id_for(key) if key else None)
    with _sending(subject, env):
        headers = headers_for(env)  # inside the span: the consumer's span is a child of this one
        if ttl is not None:
            headers[TTL_HEADER] = f"{max(1, math.ceil(ttl))}s"
        if acked:
            return await WIRE.store(js, subject, encode(env), headers)
        await WIRE.post(js._nc, subject, encode(env), headers)
        return None


class BulkPublisher:
    """Many messages into JetStream, then one wait until every one is stored.

    Each goes out as a plain publish whose reply subject says its place (`<inbox>.<round>.<i>`), and one
    subscription on this publisher's inbox takes every ack. nats-py's `publish_async` does the same with a
    future per message and each ack parsed into a `PubAck`: more than half of the cost of publishing, which
    a relay that only needs "all stored, or retry" does not need (docs/benchmarks.md). One round at a time:
    the outbox relay is its only user.
    """

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.inbox = nc.new_inbox()
        self._sub: Any = None
        self._round = 0
        self._waiting: set[int] = set()
        self._subjects: list[str] = []
        self._refused: str | None = None
        self._done = asyncio.Event()

    async def publish(self, messages: Bulk, *, timeout: float) -> None:
        """Publish `messages` (subject, payload, headers), in order; return once JetStream acked each (a
        duplicate it dropped counts: it holds the message already), raise otherwise."""
        await WIRE.store_all(self, messages, timeout)

    async def send(self, messages: Bulk, *, timeout: float) -> None:
        """`publish`, as it goes to the broker."""
        if self._sub is None:
            self._sub = await self.nc.subscribe(f"{self.inbox}.*.*", cb=self._acked)
        self._round += 1
        self._waiting, self._refused = set(range(len(messages))), None
        self._subjects = [subject for subject, _, _ in messages]
        self._done.clear()
        for i, (subject, payload, headers) in enumerate(messages):
            await self.nc.publish(subject, payload, reply=f"{self.inbox}.{self._round}.{i}", headers=headers)
        if self._waiting and not await woken(self._done, timeout):
            raise PublishFailed(f"{len(self._waiting)} of {len(messages)} not acked in {timeout:g}s")
        if self._refused is not None:
            raise PublishFailed(self._refused)

    async def _acked(self, msg: Msg) -> None:
        _, rnd, place = msg.subject.rsplit(".", 2)
        if int(rnd) != self._round:
            return  # the late ack of a round given up on
        i = int(place)
        status = (msg.headers or {}).get(api.Header.STATUS)
        if status or b'"error"' in msg.data:
            self._refused = f"{self._subjects[i]}: " + (
                "no stream takes this subject" if status == "503" else _pub_ack_error(msg.data)
            )
            self._done.set()
            return
        self._waiting.discard(i)
        if not self._waiting:
            self._done.set()


def _pub_ack_error(data: bytes) -> str:
    try:
        return str(json.loads(data)["error"]["description"])
    except (ValueError, KeyError, TypeError):
        return data.decode(errors="replace")
