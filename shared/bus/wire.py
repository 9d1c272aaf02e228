"""Where the bus touches the broker: storing a message, posting one, acking a delivery, handling one
now or later, and answering a request. Each is a plain call here; fault injection (shared/faults.py,
`install`) replaces some of them with wrappers when a process starts with RACKPLANE_FAULTS, so that the
paths every message takes carry no fault checks at all, and nothing but these contact points can be
faulted (never a fence, a generation check or a transaction)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from shared.messages import Reply

if TYPE_CHECKING:
    from shared.bus.publish import BulkPublisher

log = logging.getLogger(__name__)

Bulk = list[tuple[str, bytes, dict[str, str]]]
"""Messages of a bulk publish: subject, payload, headers."""


async def store(js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str]) -> api.PubAck:
    """Into JetStream, once it acked it."""
    return await js.publish(subject, payload, headers=headers)


async def post(nc: NATS, subject: str, payload: bytes, headers: dict[str, str]) -> None:
    """Into JetStream without waiting for its ack."""
    await nc.publish(subject, payload, headers=headers)


async def store_all(publisher: BulkPublisher, messages: Bulk, timeout: float) -> None:
    """Many messages into JetStream, once each is acked (the outbox relay's way)."""
    await publisher.send(messages, timeout=timeout)


async def settle(op: Awaitable[None]) -> None:
    """Ack/nak/term are best effort: if one is lost, JetStream redelivers and the handler is idempotent."""
    try:
        await op
    except Exception as e:
        log.info("ack/nak not sent (%s); the message will be redelivered", e)


async def ack(msg: Msg) -> bool:
    """Ack a delivery that was handled; whether it was acked (otherwise JetStream redelivers it)."""
    await settle(msg.ack())
    return True


def later(msg: Msg) -> Awaitable[None] | None:
    """What to wait for before handling `msg` on its own, or None to handle it now with its batch."""
    return None


async def answer(msg: Msg, reply: Reply, again: Callable[[], None]) -> None:
    """Send a request's reply (`again` would have the request handled once more, as a resend would)."""
    if msg.reply:
        await respond(msg, reply)


async def respond(msg: Msg, reply: Reply) -> None:
    """Answer, and never with silence: a reply that cannot be sent (too large for the broker, say) is
    answered with an error that says why, so the caller learns at once instead of waiting out its timeout."""
    try:
        await msg.respond(reply.model_dump_json().encode())
        return
    except nats.errors.MaxPayloadError as e:
        why = {"code": "too_large", "message": f"the reply is too large to send ({e}): ask for less"}
    except Exception as e:
        why = {"code": "internal", "message": f"the reply could not be sent: {type(e).__name__}: {e}"}
    log.warning("reply to %s not sent: %s", msg.subject, why["message"])
    try:
        await msg.respond(Reply(ok=False, error=why).model_dump_json().encode())
    except Exception as e:
        log.info("error reply to %s not sent either: %s", msg.subject, e)


class Wire:
    """The contact points the bus calls, through this one object (`WIRE`), so that a wrapper installed
    on it applies everywhere at once."""

    def __init__(self) -> None:
        self.store: Callable[[JetStreamContext, str, bytes, dict[str, str]], Awaitable[api.PubAck]] = store
        self.post: Callable[[NATS, str, bytes, dict[str, str]], Awaitable[None]] = post
        self.store_all: Callable[[BulkPublisher, Bulk, float], Awaitable[None]] = store_all
        self.ack: Callable[[Msg], Awaitable[bool]] = ack
        self.later: Callable[[Msg], Awaitable[None] | None] = later
        self.answer: Callable[[Msg, Reply, Callable[[], None]], Awaitable[None]] = answer
        self.installed: Any = None
        """What installed wrappers (the fault layer of shared/faults.py), or None: plain calls."""


WIRE = Wire()
