"""Request/reply: operator commands answered (`serve`), every failure a clear reply, and sent
(`request`), the reply's data or a `CommandError` with the server's message."""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.semconv._incubating.attributes.messaging_attributes import (
    MESSAGING_CONSUMER_GROUP_NAME,
    MESSAGING_MESSAGE_ID,
)
from opentelemetry.semconv._incubating.attributes.messaging_attributes import (
    MessagingOperationTypeValues as Op,
)

from shared import telemetry
from shared.bus.connect import unless_denied
from shared.bus.errors import CommandError, NoReply
from shared.bus.publish import headers_for
from shared.bus.wire import WIRE, respond
from shared.errors import transient, unreachable
from shared.messages import BadMessage, Model, Reply, decode, encode, envelope
from shared.topology import subjects

log = logging.getLogger(__name__)

REQUEST: contextvars.ContextVar[tuple[uuid.UUID, str] | None] = contextvars.ContextVar(
    "request", default=None
)
"""While a command's handler runs (`serve`): its envelope id, and a digest of what it asks (subject and
body), so that a handler can recognise a copy of a command it has already handled."""


def request_digest(subject: str, data: dict[str, Any]) -> str:
    """What a command asks, as a short digest: a request id reused for another command is told apart."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(f"{subject}\n{canonical}".encode()).hexdigest()[:32]


CommandHandler = Callable[[Any, Msg], Awaitable[Any]]


async def serve(
    nc: NATS,
    subject: str,
    handlers: dict[type[Model], CommandHandler],
    *,
    queue: str,
    check_silo: bool = True,
    admit: Callable[[Msg], CommandError | None] | None = None,
    remember: int = 0,
) -> Any:
    """Answer commands on `subject`; each body type goes to its handler; every failure is a clear reply.

    With `check_silo`, a body that names a silo must arrive on that silo's subject, so that permissions
    granted per silo subject cannot be bypassed by naming another silo in the body.

    With `remember`, the replies to the last `remember` commands are kept in memory, by envelope id and
    digest: a copy of one (a caller's resend) gets the first's reply (awaited while it is being made)
    instead of running again. For a service of one process; a replicated one records its replies in its
    database instead (`REQUEST`).
    """
    expect = tuple(handlers)
    replies: OrderedDict[tuple[str, str], asyncio.Future[Reply]] = OrderedDict()

    async def answer(msg: Msg) -> None:
        reply = await (handle_once(msg) if remember else handle(msg))
        await WIRE.answer(msg, reply, lambda: spawn(handle(msg)))

    async def handle_once(msg: Msg) -> Reply:
        """`handle`, or the reply to an earlier copy of this very command."""
        try:
            sent = json.loads(msg.data)
            key = (str(sent["id"]), request_digest(msg.subject, sent.get("data")))
        except Exception:  # not even an envelope: `handle` says why
            return await handle(msg)
        if (first := replies.get(key)) is not None:
            return await asyncio.shield(first)
        mine: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        replies[key] = mine
        while len(replies) > remember:
            replies.popitem(last=False)
        try:
            reply = await handle(msg)
        except BaseException:  # cancelled: a copy runs it again
            replies.pop(key, None)
            mine.cancel()
            raise
        if not reply.ok and (reply.error or {}).get("code") == "unavailable":
            replies.pop(key, None)  # nothing was done: a copy tries again
        mine.set_result(reply)
        return reply

    async def handle(msg: Msg) -> Reply:
        try:
            env, body = decode(msg.data, expect)
            REQUEST.set((env.id, request_digest(msg.subject, env.data)))
            if wrong_subject := subjects.command_error(msg.subject, env.schema_):
                raise CommandError("forbidden", wrong_subject)
            if check_silo:
                named = getattr(body, "silo", None) or subjects.FLEET
                token = subjects.silo_of(msg.subject)
                if token != named and not (token == subjects.FLEET and named != subjects.FLEET):
                    raise CommandError(
                        "forbidden", f"command for silo {named!r} sent on the subject of {token!r}"
                    )
            with telemetry.messaging_span(
                msg.subject,
                Op.PROCESS,
                telemetry.SpanKind.SERVER,
                msg.headers,
                **{MESSAGING_MESSAGE_ID: str(env.id)},
                **({MESSAGING_CONSUMER_GROUP_NAME: queue} if queue else {}),
            ):
                data = await handlers[type(body)](body, msg)
            reply = Reply(ok=True, data=data)
        except BadMessage as e:
            telemetry.count("commands.rejected")
            reply = Reply(ok=False, error={"code": e.code, "message": e.reason})
        except CommandError as e:
            reply = Reply(ok=False, error={"code": e.code, "message": e.message})
        except Exception as e:
            if transient(e):  # the database or the broker is away for a while: the caller may retry
                log.warning("command on %s not served: %s: %s", msg.subject, type(e).__name__, e)
                why = f"the service cannot reach its database or broker right now ({unreachable(e)})"
                reply = Reply(ok=False, error={"code": "unavailable", "message": f"{why}; try again"})
            else:
                log.exception("command on %s failed", msg.subject)
                reply = Reply(ok=False, error={"code": "internal", "message": f"{type(e).__name__}: {e}"})
        return reply

    tasks: set[asyncio.Task[Any]] = set()

    def spawn(coro: Awaitable[Any]) -> None:
        t = asyncio.ensure_future(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    async def on_msg(msg: Msg) -> None:
        # `admit` (a rate limit) refuses before anything else, the message not even decoded: cheap enough
        # that a flood of refused commands takes little from everyone else's
        if admit is not None and (refused := admit(msg)) is not None:
            if msg.reply:
                await respond(msg, Reply(ok=False, error={"code": refused.code, "message": refused.message}))
            return
        spawn(answer(msg))

    if _STOPPING:
        raise asyncio.CancelledError  # asked to stop before this subscription was made: none is
    sub = await nc.subscribe(subject, queue=queue, cb=on_msg)
    _SERVING.append((sub, tasks))
    return sub


_SERVING: list[tuple[Any, set[asyncio.Task[Any]]]] = []
"""Every command subscription of this process, with the commands it has in hand (`stop_serving`)."""
_STOPPING: list[bool] = []
"""Non-empty once `stop_serving` ran: no command subscription is made after it."""


async def stop_serving(within: float) -> None:
    """Take no more commands, and answer those in hand for up to `within` seconds: a process asked to stop
    leaves its queue group at once, so its peers (another replica) take every new command, and the
    commands it took are answered rather than cut off (a caller would have to send them again). Each
    subscription is drained (nats-py: unsubscribe, a round trip to the server, then every message it had
    delivered is handed over), so no command sent to this process before it left goes unanswered."""
    _STOPPING.append(True)
    serving, _SERVING[:] = list(_SERVING), []
    deadline = asyncio.get_running_loop().time() + within
    for sub, _ in serving:
        with suppress(Exception):  # the connection gone already: nothing more comes
            async with asyncio.timeout_at(max(deadline, asyncio.get_running_loop().time() + 0.1)):
                await sub.drain()
    in_hand = {t for _, tasks in serving for t in tasks}
    if in_hand:
        log.info("stopping: answering the %d command(s) in hand", len(in_hand))
        await asyncio.wait(in_hand, timeout=max(deadline - asyncio.get_running_loop().time(), 0.1))


async def request(
    nc: NATS,
    subject: str,
    body: Model,
    *,
    source: str,
    timeout: float = 10.0,
    request_id: uuid.UUID | None = None,
) -> Any:
    """Send a command and return the reply's data, or raise CommandError with the server's message
    (NoReply when no reply came). `request_id`: the envelope id, the same for every copy of one command
    sent again (rackctl's client), so that the service recognises it."""
    env = envelope(body, source, request_id)
    try:
        with telemetry.messaging_span(
            subject, Op.SEND, telemetry.SpanKind.CLIENT, **{MESSAGING_MESSAGE_ID: str(env.id)}
        ):
            call = nc.request(subject, encode(env), timeout=timeout, headers=headers_for(env))
            msg = await unless_denied(nc, subject, call)
    except nats.errors.NoRespondersError:
        raise NoReply("unavailable", f"no service answers {subject}: is the stack running?") from None
    except nats.errors.TimeoutError:
        raise NoReply("timeout", f"no reply on {subject} within {timeout:g}s") from None
    except (nats.errors.ConnectionReconnectingError, nats.errors.StaleConnectionError) as e:
        raise NoReply("lost", f"the connection was lost while {subject} was out ({e})") from None
    reply = Reply.model_validate_json(msg.data)
    if not reply.ok:
        err = reply.error or {}
        raise CommandError(err.get("code", "error"), err.get("message", "unknown error"))
    return reply.data
