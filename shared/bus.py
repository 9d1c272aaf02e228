"""NATS and JetStream, the way every service uses them.

- `connect`: a connection that reconnects forever (the default gives up after about two minutes), with
  the client's own credential (an nkey seed), its private reply inbox, and TLS when a CA is given.
- `publish`: one envelope to JetStream with `Nats-Msg-Id` (the broker drops repeats inside the window)
  and the trace context in headers.
- `BulkPublisher`: many messages at once, one wait for all their acks (the outbox relay's way).
- `Consumer`: a durable pull consumer that acks only after its handler returned (so after the handler's
  transaction committed), naks on transient failure, and dead-letters what it can never handle, with the
  reason, so that nothing is lost and the loop goes on. It fetches through `Pull`: one pull request and
  one wait a batch, not nats-py's task and timer a message.
- `serve` / `request`: operator commands as request/reply, with errors as clear replies.

Fault injection (`shared/faults.py`) hooks into `publish` and `Consumer`; it costs one attribute check
while it is off, which it is unless a test or an operator turns it on.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import math
import ssl
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from opentelemetry.semconv._incubating.attributes.messaging_attributes import (
    MESSAGING_BATCH_MESSAGE_COUNT,
    MESSAGING_CONSUMER_GROUP_NAME,
    MESSAGING_DESTINATION_TEMPLATE,
    MESSAGING_MESSAGE_BODY_SIZE,
    MESSAGING_MESSAGE_ID,
    MESSAGING_SYSTEM,
)
from opentelemetry.semconv._incubating.attributes.messaging_attributes import (
    MessagingOperationTypeValues as Op,
)
from opentelemetry.semconv._incubating.metrics.messaging_metrics import MESSAGING_PROCESS_DURATION

from shared import metrics, subjects, telemetry
from shared.config import ack_wait as ack_wait_default
from shared.crash import crash_point
from shared.errors import transient
from shared.faults import FAULTS
from shared.messages import BadMessage, Envelope, Model, Reply, decode, encode, envelope

log = logging.getLogger(__name__)

MSG_ID = "Nats-Msg-Id"
TTL_HEADER = "Nats-TTL"
"""How long a stream that allows per-message TTLs keeps this message (`post`'s `ttl`)."""
T = TypeVar("T")


class CommandError(Exception):
    """A command that was understood and refused: the reply says why, in one line."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class NotFound(CommandError):
    def __init__(self, message: str) -> None:
        super().__init__("not_found", message)


class Conflict(CommandError):
    def __init__(self, message: str) -> None:
        super().__init__("conflict", message)


class NoReply(CommandError):
    """No reply came (none within the timeout, no service subscribed, or the connection was lost while
    the request was out): the command may or may not have run. The caller may send it again with the same
    envelope id, which the services recognise (`REQUEST`), so that it takes effect once."""


REQUEST: contextvars.ContextVar[tuple[uuid.UUID, str] | None] = contextvars.ContextVar(
    "request", default=None
)
"""While a command's handler runs (`serve`): its envelope id, and a digest of what it asks (subject and
body), so that a handler can recognise a copy of a command it has already handled."""


def request_digest(subject: str, data: dict[str, Any]) -> str:
    """What a command asks, as a short digest: a request id reused for another command is told apart."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(f"{subject}\n{canonical}".encode()).hexdigest()[:32]


class Reject(Exception):
    """Raised by a stream handler for a message that must never be applied (a forgery, or a claim its
    sender may not make): it is dead-lettered at once with the reason, and nothing it carried is applied."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Retry(Exception):
    """Raised by a stream handler when the message cannot be applied yet (it is redelivered later)."""

    def __init__(self, reason: str, delay: float = 0.5) -> None:
        super().__init__(reason)
        self.delay = delay


def servers(url: str) -> list[str]:
    """The servers a NATS_URL names: one, or several comma-separated (spaces around them ignored)."""
    return [u.strip() for u in url.split(",") if u.strip()]


async def connect(
    url: str,
    name: str,
    *,
    retry_for: float = 30.0,
    seed_file: str | None = None,
    inbox_prefix: str | None = None,
    ca_file: str | None = None,
    on_closed: Callable[[str], None] | None = None,
) -> NATS:
    """Connect, waiting up to `retry_for` seconds for the broker to come up; reconnect forever after.

    The broker ends a connection for good on a protocol error (nats-py then closes it rather than
    reconnect); `on_closed` is called with the reason when that happens, not when the caller closes it.

    `seed_file` is the identity's nkey seed (deploy/identities.py); `inbox_prefix` its private inbox, the
    only one its permissions let it read replies on; `ca_file` the CA that signed the server's certificate
    (the connection then uses TLS). (nats-py retries a first connection forever when reconnects are
    unlimited, so the wait is bounded here.) `url` may name several servers, comma-separated (the nodes
    of a cluster, `make run HA=1`): the client connects to one and moves to another when it goes.
    """
    last_error: list[Exception] = []

    denials = Denials()

    async def on_error(e: Exception) -> None:
        if denials.note(e):
            log.warning("%s: %s", name, e)
            return
        if not (last_error and "Authorization" in str(last_error[0])):  # the reason that matters most
            last_error[:] = [e]
        log.warning("%s: nats error: %s", name, e)

    connected: list[NATS] = []

    async def on_disconnect() -> None:
        if connected and connected[0].is_closed:  # closed on purpose: nothing to warn about
            return
        log.warning("%s: disconnected from nats", name)

    async def on_reconnect() -> None:
        log.info("%s: reconnected to nats", name)

    async def on_close() -> None:
        nc = connected[0] if connected else None
        if on_closed is not None and nc is not None and nc.last_error is not None:
            on_closed(f"the broker closed the connection: {nc.last_error}")

    options: dict[str, Any] = {}
    if seed_file:
        options["nkeys_seed"] = seed_file
    if inbox_prefix:
        options["inbox_prefix"] = inbox_prefix
    if ca_file:
        options["tls"] = ssl.create_default_context(cafile=ca_file)
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                servers(url),
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                connect_timeout=2,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                closed_cb=on_close,
                **options,
            ),
            retry_for,
        )
    except (TimeoutError, OSError, nats.errors.Error) as e:
        why = last_error[0] if last_error else e
        if "Authorization" in str(why):
            whose = "a credential it does not accept" if seed_file else "no credential"
            raise ConnectionError(
                f"nats at {url} refused the connection (Authorization Violation): {whose} "
                "(docs/security.md: rackctl takes its credential from a context)"
            ) from None
        raise ConnectionError(f"cannot reach nats at {url} within {retry_for:g}s: {why}") from None
    _DENIALS[nc] = denials
    connected.append(nc)
    return nc


class Denials:
    """The broker's "Permissions Violation" errors on one connection, so that a request it refused fails
    at once with a clear reason instead of waiting out its timeout."""

    PREFIX = "nats: permissions violation for publish to "

    def __init__(self) -> None:
        self.waiting: dict[str, list[asyncio.Future[str]]] = {}

    def note(self, e: Exception) -> bool:
        text = str(e)
        if "permissions violation" not in text.lower():
            return False
        if text.lower().startswith(self.PREFIX):
            subject = text[len(self.PREFIX) :].strip().strip('"').lower()  # the error comes lowercased
            for f in self.waiting.pop(subject, []):
                if not f.done():
                    f.set_result(text)
        return True

    def watch(self, subject: str) -> asyncio.Future[str]:
        f: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(subject.lower(), []).append(f)
        return f

    def forget(self, subject: str, f: asyncio.Future[str]) -> None:
        if f in (waiting := self.waiting.get(subject.lower(), [])):
            waiting.remove(f)
            if not waiting:
                del self.waiting[subject.lower()]


_DENIALS: weakref.WeakKeyDictionary[NATS, Denials] = weakref.WeakKeyDictionary()


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


DLQ_TRUNCATED = "Rp-Dlq-Truncated"
"""Header of a dead letter whose body did not fit beside its headers: the original body's size in bytes
(the letter keeps the body's beginning; it can be read, not replayed)."""


def _sending(subject: str, env: Envelope) -> AbstractContextManager[Any]:
    return telemetry.messaging_span(
        subject, Op.SEND, telemetry.SpanKind.PRODUCER, **{MESSAGING_MESSAGE_ID: str(env.id)}
    )


async def publish(
    js: JetStreamContext, subject: str, body: Model, *, source: str, key: str | None = None
) -> api.PubAck:
    env = envelope(body, source, msg_id_for(key) if key else None)
    with _sending(subject, env):
        if FAULTS.active:
            return await FAULTS.publish(js, subject, encode(env), headers_for(env))
        return await js.publish(subject, encode(env), headers=headers_for(env))


async def post(nc: NATS, subject: str, body: Model, *, source: str, ttl: float | None = None) -> None:
    """Into JetStream without waiting for its ack: for state that the next message of its kind supersedes
    (a sled's inventory), where a lost one costs nothing and a wait costs a future, a timer and a parsed
    ack per message (a third of a rack simulator's time). `ttl`: seconds the stream keeps it (its
    `Nats-TTL`; the stream must allow per-message TTLs). Under fault injection it goes as `publish`
    does, so that the faults apply."""
    env = envelope(body, source)
    headers = headers_for(env)
    if ttl is not None:
        headers[TTL_HEADER] = f"{max(1, math.ceil(ttl))}s"
    with _sending(subject, env):
        if FAULTS.active:
            await FAULTS.publish(nc.jetstream(), subject, encode(env), headers)
        else:
            await nc.publish(subject, encode(env), headers=headers)


class PublishFailed(Exception):
    """JetStream refused a message of a bulk publish (or no stream takes its subject)."""


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

    async def publish(self, messages: list[tuple[str, bytes, dict[str, str]]], *, timeout: float) -> None:
        """Publish `messages` (subject, payload, headers), in order; return once JetStream acked each (a
        duplicate it dropped counts: it holds the message already), raise otherwise."""
        if self._sub is None:
            self._sub = await self.nc.subscribe(f"{self.inbox}.*.*", cb=self._acked)
        self._round += 1
        self._waiting, self._refused = set(range(len(messages))), None
        self._subjects = [subject for subject, _, _ in messages]
        self._done.clear()
        for i, (subject, payload, headers) in enumerate(messages):
            await self.nc.publish(subject, payload, reply=f"{self.inbox}.{self._round}.{i}", headers=headers)
        try:
            if self._waiting:
                await asyncio.wait_for(self._done.wait(), timeout)
        except TimeoutError:
            raise PublishFailed(
                f"{len(self._waiting)} of {len(messages)} not acked in {timeout:g}s"
            ) from None
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


# --- stream consumers ----------------------------------------------------------------------------------


class FetchFailed(Exception):
    """The broker ended a pull with an error (no such consumer, the consumer deleted): subscribe anew."""


class Pull:
    """Fetches from one durable pull consumer: each fetch is one pull request, whose messages a callback
    collects into a list, and one wait until the request is over (its batch delivered, or the broker's
    status that ends it).

    nats-py's `fetch` waits for each message of a batch with a task and a timer of its own (`next_msg`):
    a tenth of what a consumer of a thousand-message batch spends (docs/benchmarks.md, the accounting
    benchmark). The request asks for what is there at once (`no_wait`), waiting up to `timeout` for a
    first message when there is none, so a fetch returns as soon as messages have come, as nats-py's
    does. Each request has a reply subject of its own (`<inbox>.<n>`), so a status that ends an earlier
    request, one given up on, is told apart; messages it delivers late are kept for the next fetch (they
    are ordinary deliveries: acked once handled, or redelivered after the ack wait)."""

    MARGIN = 0.25
    """Seconds past the request's expiry that a fetch waits for the broker's status that ends it, before
    taking it as forgotten (a broker that restarted forgets pending pulls) and asking again."""

    def __init__(self, js: JetStreamContext, stream: str, durable: str) -> None:
        self.nc: NATS = js._nc
        self.next_subject = f"{js._prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.inbox = self.nc.new_inbox()
        self._sub: Any = None
        self._request = 0
        self._wanted = 0
        self._got: list[Msg] = []
        self._over: asyncio.Future[None] | None = None
        self._error: FetchFailed | None = None

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """Up to `batch` messages, as soon as there are some; TimeoutError if none came in `timeout`."""
        if self._sub is None:
            self._sub = await self.nc.subscribe(f"{self.inbox}.*", cb=self._delivered)
        if not self._got:  # what an earlier request delivered late is handed out first, without asking
            self._request += 1
            self._wanted, self._error = batch, None
            self._over = over = asyncio.get_running_loop().create_future()
            ask = {"batch": batch, "expires": int(timeout * 1e9), "no_wait": True}
            await self.nc.publish(
                self.next_subject, json.dumps(ask).encode(), reply=f"{self.inbox}.{self._request}"
            )
            try:
                await asyncio.wait_for(over, timeout + self.MARGIN)
            except TimeoutError:
                pass
        msgs, self._got = self._got[:batch], self._got[batch:]
        if not msgs:
            if self._error is not None:
                raise self._error
            raise TimeoutError
        return msgs

    async def _delivered(self, msg: Msg) -> None:
        """A message of the consumer, or the broker's status on a request (its reply subject is ours)."""
        if not msg.subject.startswith(self.inbox):
            self._got.append(msg)
            if len(self._got) >= self._wanted:
                self._end()
            return
        if msg.subject != f"{self.inbox}.{self._request}":
            return  # the end of a request given up on
        status = (msg.headers or {}).get(api.Header.STATUS, "")
        if status == "100":  # a heartbeat
            return
        description = (msg.headers or {}).get(api.Header.DESCRIPTION, "")
        if status not in ("404", "408"):  # 404, 408: nothing more to deliver, or the request expired
            why = "no such consumer" if status == "503" else description.strip() or "no description"
            self._error = FetchFailed(f"{self.next_subject}: {status} {why}")
        self._end()

    def _end(self) -> None:
        if self._over is not None and not self._over.done():
            self._over.set_result(None)

    async def close(self) -> None:
        """Stop listening (best effort: the connection may be gone already)."""
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None


Handler = Callable[[Envelope, Any, Msg], Awaitable[None]]


class Consumer:
    """One durable pull consumer and its loop. The handler must be idempotent: delivery is at least once."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        service: str,
        stream: str,
        durable: str,
        filter_subject: str,
        handler: Handler,
        expect: type[Model] | tuple[type[Model], ...] | None = None,
        max_deliver: int = 8,
        ack_wait: float | None = None,
        batch: int = 64,
        verify: Callable[[str, Any], str | None] | None = None,
        dead_letters: str | None = None,
        idle_wait: float = 1.0,
    ) -> None:
        self.js = js
        self.service = service
        self.stream = stream
        self.durable = durable
        self.filter_subject = filter_subject
        self.handler = handler
        self.expect = expect
        self.max_deliver = max_deliver
        self.ack_wait = ack_wait if ack_wait is not None else ack_wait_default()
        """How long JetStream waits for an ack before redelivering (RACKPLANE_ACK_WAIT by default)."""
        self.batch = batch
        self.verify = verify
        """Checks a valid message against its subject; a reason means it is dead-lettered unhandled."""
        self.dead_letters = dead_letters or durable
        """The consumer name its dead letters are filed under (`rp.dlq.<service>.<name>`): one name for the
        durables of all partitions of one stream."""
        self.idle_wait = idle_wait
        """Seconds a fetch waits for a first message. Messages end the wait at once; what it bounds is the
        broker's load from idle consumers (a pull request and a probe each time it runs out) and, after a
        broker restart, which forgets pending pulls, how long until this consumer asks again."""
        self._tasks: set[asyncio.Task[None]] = set()

    async def _subscribe(self) -> Pull:
        """The durable, created if it is not there (as `js.pull_subscribe` would), and a `Pull` on it."""
        config = api.ConsumerConfig(
            name=self.durable,
            durable_name=self.durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait,
            max_deliver=-1,  # we dead-letter ourselves, with the reason, after max_deliver attempts
            filter_subject=self.filter_subject,
            max_ack_pending=10_000,
        )
        try:
            await self.js.consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            await self.js.add_consumer(self.stream, config=config)
        return Pull(self.js, self.stream, self.durable)

    async def run(self) -> None:
        sub = None
        while True:
            try:
                if sub is None:
                    sub = await self._subscribe()
                msgs = await sub.fetch(self.batch, timeout=self.idle_wait)
            except TimeoutError:  # nothing to fetch (nats-py may raise a bare one when its deadline ran out)
                self._pending([])
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if sub is not None:
                    await sub.close()
                sub = None
                await self._fetch_failed(e)
                continue
            self._pending(msgs)
            for msg in msgs:
                if FAULTS.active and FAULTS.slows(msg):  # so that its redelivery overtakes it: see faults.py
                    task = asyncio.create_task(self.handle(msg))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                else:
                    await self.handle(msg)

    async def _fetch_failed(self, e: Exception) -> None:
        """The broker is restarting, the consumer is gone or the connection closed: say so, count it and
        wait a little; the caller subscribes anew."""
        log.warning("%s/%s: fetch failed (%s); retrying", self.service, self.durable, e)
        telemetry.count("fetch_errors", consumer=self.durable)
        await asyncio.sleep(0.5)

    async def _admit(self, msg: Msg) -> tuple[Envelope, Any] | None:
        """The message decoded and verified against its subject, or None once it is dead-lettered."""
        try:
            env, body = decode(msg.data, self.expect)
        except BadMessage as e:
            await self._dead_letter(msg, f"{e.code}: {e.reason}")
            return None
        if self.verify is not None and (refused := self.verify(msg.subject, body)):
            await self._dead_letter(msg, refused)
            return None
        return env, body

    async def handle(self, msg: Msg) -> None:
        if (admitted := await self._admit(msg)) is None:
            return
        env, body = admitted
        try:
            with self._processing(
                msg, **{MESSAGING_MESSAGE_ID: str(env.id), MESSAGING_MESSAGE_BODY_SIZE: len(msg.data or b"")}
            ):
                if FAULTS.active:
                    await FAULTS.before_handler(msg)
                await self.handler(env, body, msg)
        except Reject as r:
            await self._dead_letter(msg, r.reason)
            return
        except Retry as r:
            telemetry.count("retried", consumer=self.durable)
            await _settle(msg.nak(delay=r.delay))
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self._failed(msg, e)
            return
        if FAULTS.active and FAULTS.holds_ack(msg):
            return  # held back on purpose: JetStream redelivers it after ack_wait
        crash_point(f"after-commit:{self.durable}")
        await _settle(msg.ack())
        telemetry.count("handled", consumer=self.durable)

    @contextmanager
    def _processing(self, msg: Msg, **attributes: Any) -> Iterator[None]:
        """Handling `msg` (or a batch that starts with it): its duration, and its CONSUMER span."""
        with (
            metrics.timed(MESSAGING_PROCESS_DURATION, **self._metric_attributes(msg)),
            telemetry.messaging_span(
                msg.subject,
                Op.PROCESS,
                telemetry.SpanKind.CONSUMER,
                msg.headers,
                **{MESSAGING_CONSUMER_GROUP_NAME: self.durable, **attributes},
            ),
        ):
            yield

    def _metric_attributes(self, msg: Msg) -> dict[str, str]:
        """A handler duration's attributes: few values each, so the histogram stays small."""
        return {
            MESSAGING_SYSTEM: telemetry.NATS,
            MESSAGING_CONSUMER_GROUP_NAME: self.durable,
            MESSAGING_DESTINATION_TEMPLATE: subjects.template(msg.subject),
        }

    def _pending(self, msgs: list[Msg]) -> None:
        """Consumer lag: how many messages the broker still holds for this consumer after the last one
        fetched (each JetStream message carries it), none once a fetch found nothing."""
        metrics.gauge("pending", msgs[-1].metadata.num_pending if msgs else 0, consumer=self.durable)

    async def _failed(self, msg: Msg, e: Exception) -> None:
        """The handler raised: retry while the infrastructure is away, else a few times, then dead-letter."""
        delivered = msg.metadata.num_delivered
        if transient(e):  # the database or broker is away: retry for as long as it takes
            log.warning("%s/%s: handler waits for the infrastructure: %s", self.service, self.durable, e)
            telemetry.count("transient_errors", consumer=self.durable)
            await _settle(msg.nak(delay=min(0.1 * 2**delivered, 2.0)))
            return
        log.error("%s/%s: handler failed (delivery %d)", self.service, self.durable, delivered, exc_info=e)
        if delivered >= self.max_deliver:
            await self._dead_letter(msg, f"handler failed {delivered} times: {type(e).__name__}: {e}")
        else:
            await _settle(msg.nak(delay=min(0.1 * 2**delivered, 5.0)))

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        """Park the message with its reason in the DLQ stream, then stop its redelivery.

        Each filing has an id of its own, which no one can guess: an id made from the message (its stream
        and sequence) could be published first by any identity that may file letters, inside the DLQ's
        duplicate window, and the broker would drop the real letter as a repeat; and two consumers giving
        up on one message would keep one letter. A letter filed twice (its `term` lost) is stored twice;
        `rackctl dlq list` shows such repeats as one (rackctl/dlq.py)."""
        meta = msg.metadata
        headers = {
            MSG_ID: f"dlq:{uuid.uuid4()}",
            "Rp-Dlq-Reason": reason[:1000],
            "Rp-Dlq-Subject": msg.subject,
            "Rp-Dlq-Stream": self.stream,
            "Rp-Dlq-Sequence": str(meta.sequence.stream),
            "Rp-Dlq-Consumer": self.durable,
        }
        data = msg.data or b""
        limit = self.js._nc.max_payload  # the broker's, from its INFO
        if wire_size(data, headers) > limit:  # a body near the limit, which the headers push over it
            headers[DLQ_TRUNCATED] = str(len(data))
            data = data[: max(0, limit - wire_size(b"", headers))]
        try:
            await self.js.publish(
                subjects.dead_letter(self.service, self.dead_letters), data, headers=headers
            )
        except Exception as e:
            log.warning("%s/%s: dead-letter failed (%s); will retry", self.service, self.durable, e)
            await _settle(msg.nak(delay=1.0))
            return
        log.warning("%s/%s: dead-lettered %s: %s", self.service, self.durable, msg.subject, reason)
        telemetry.count("dead_lettered", consumer=self.durable)
        await _settle(msg.term())


@dataclass
class Delivery:
    """One decoded message of a batch. The batch handler sets `refused` on a message it did not apply
    (a `Retry` to have it redelivered later, a `Reject` to dead-letter it); the others are acked."""

    env: Envelope
    body: Any
    msg: Msg
    refused: Retry | Reject | None = None


BatchHandler = Callable[[list[Delivery]], Awaitable[None]]


async def _unused(env: Envelope, body: Any, msg: Msg) -> None:
    raise NotImplementedError("a batch consumer hands whole batches to its batch handler")


class BatchConsumer(Consumer):
    """A durable pull consumer that hands its handler every message a fetch returned, at once.

    The handler applies the batch in one transaction; after it returned, every message it did not refuse
    is acked (so after the commit). The next fetch is already on its way while a batch is applied. A
    message that cannot be decoded or verified is dead-lettered alone before the handler sees the batch;
    if the handler fails on a batch, the batch is split in halves and each applied on its own, so that
    one poison message ends up alone (and then goes the way of `Consumer.handle`: retried, and
    dead-lettered after `max_deliver` attempts) while the rest of the batch still applies.
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        batch_handler: BatchHandler,
        batch: int = 1000,
        caught_up: asyncio.Event | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(js, handler=_unused, batch=batch, **kw)
        self.batch_handler = batch_handler
        self.caught_up = caught_up
        """Set while the broker holds nothing more for this consumer than what it has applied; cleared
        while a backlog waits. Work that should come after this consumer's can wait on it."""

    async def run(self) -> None:
        sub = None
        pending: asyncio.Task[list[Msg]] | None = None
        try:
            while True:
                try:
                    if sub is None:
                        sub = await self._subscribe()
                    if pending is None:
                        pending = asyncio.ensure_future(sub.fetch(self.batch, timeout=self.idle_wait))
                    msgs = await pending
                    pending = asyncio.ensure_future(sub.fetch(self.batch, timeout=self.idle_wait))
                except TimeoutError:
                    pending = None
                    self._pending([])
                    self._caught_up(True)
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    if sub is not None:
                        await sub.close()
                    sub, pending = None, None
                    self._caught_up(True)  # nothing waits on a consumer that cannot fetch
                    await self._fetch_failed(e)
                    continue
                self._pending(msgs)
                behind = bool(msgs) and msgs[-1].metadata.num_pending > 0
                if behind:
                    self._caught_up(False)
                await self.handle_batch(msgs)
                if not behind:  # what the prefetch brought meanwhile is a backlog too
                    self._caught_up(not _fetched(pending))
        finally:
            if pending is not None:
                pending.cancel()
            if sub is not None:
                await sub.close()

    def _caught_up(self, caught_up: bool) -> None:
        if self.caught_up is not None:
            (self.caught_up.set if caught_up else self.caught_up.clear)()

    async def handle_batch(self, msgs: list[Msg]) -> None:
        batch: list[Delivery] = []
        for msg in msgs:
            if (admitted := await self._admit(msg)) is None:
                continue
            env, body = admitted
            if FAULTS.active and FAULTS.slows(msg):  # handled late, alone: its redelivery overtakes it
                task = asyncio.create_task(self._slowly(Delivery(env, body, msg)))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                continue
            batch.append(Delivery(env, body, msg))
        if batch:
            await self._apply(batch)

    async def _slowly(self, d: Delivery) -> None:
        await FAULTS.before_handler(d.msg)
        await self._apply([d])

    async def _apply(self, batch: list[Delivery]) -> None:
        first = batch[0].msg
        try:
            with self._processing(first, **{MESSAGING_BATCH_MESSAGE_COUNT: len(batch)}):
                await self.batch_handler(batch)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if transient(
                e
            ):  # the database or broker is away: the whole batch is retried, for as long as it takes
                log.warning("%s/%s: batch waits for the infrastructure: %s", self.service, self.durable, e)
                telemetry.count("transient_errors", consumer=self.durable)
                for d in batch:
                    await _settle(d.msg.nak(delay=min(0.1 * 2**d.msg.metadata.num_delivered, 2.0)))
                return
            if len(batch) == 1:  # alone: retried a few times, then dead-lettered with the reason
                await self._failed(batch[0].msg, e)
                return
            log.warning(
                "%s/%s: batch of %d failed (%s); splitting it", self.service, self.durable, len(batch), e
            )
            telemetry.count("batch_splits", consumer=self.durable)
            half = len(batch) // 2
            await self._apply(batch[:half])
            await self._apply(batch[half:])
            return
        crash_point(f"after-commit:{self.durable}")
        telemetry.count("batches", consumer=self.durable)
        for d in batch:
            if isinstance(d.refused, Reject):
                await self._dead_letter(d.msg, d.refused.reason)
            elif isinstance(d.refused, Retry):
                telemetry.count("retried", consumer=self.durable)
                await _settle(d.msg.nak(delay=d.refused.delay))
            elif not (FAULTS.active and FAULTS.holds_ack(d.msg)):  # a held ack: redelivered after ack_wait
                await _settle(d.msg.ack())
                telemetry.count("handled", consumer=self.durable)


def _fetched(fetch: asyncio.Future[list[Msg]]) -> bool:
    """Whether a fetch has finished and brought messages (not an error, not nothing)."""
    return fetch.done() and not fetch.cancelled() and fetch.exception() is None and bool(fetch.result())


async def _settle(op: Awaitable[None]) -> None:
    """Ack/nak/term are best effort: if one is lost, JetStream redelivers and the handler is idempotent."""
    try:
        await op
    except Exception as e:
        log.info("ack/nak not sent (%s); the message will be redelivered", e)


# --- request / reply -----------------------------------------------------------------------------------

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
        if FAULTS.active and FAULTS.duplicates_request(msg.subject):
            spawn(handle(msg))  # the same request again, as a sender's retry would come; its reply dropped
        if msg.reply and (not FAULTS.active or await FAULTS.before_reply(msg.subject)):
            await _respond(msg, reply)

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
                why = f"the service cannot reach its database or broker right now ({type(e).__name__}: {e})"
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
                await _respond(msg, Reply(ok=False, error={"code": refused.code, "message": refused.message}))
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
            await asyncio.wait_for(sub.drain(), max(deadline - asyncio.get_running_loop().time(), 0.1))
    in_hand = {t for _, tasks in serving for t in tasks}
    if in_hand:
        log.info("stopping: answering the %d command(s) in hand", len(in_hand))
        await asyncio.wait(in_hand, timeout=max(deadline - asyncio.get_running_loop().time(), 0.1))


async def _respond(msg: Msg, reply: Reply) -> None:
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
    denials = _DENIALS.get(nc)
    try:
        with telemetry.messaging_span(
            subject, Op.SEND, telemetry.SpanKind.CLIENT, **{MESSAGING_MESSAGE_ID: str(env.id)}
        ):
            call = nc.request(subject, encode(env), timeout=timeout, headers=headers_for(env))
            if denials is None:
                msg = await call
            else:
                msg = await _unless_denied(call, subject, denials)
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


async def unless_denied(nc: NATS, subject: str, call: Awaitable[T]) -> T:
    """`call`, a request sent on `subject` (a JetStream API call, say), or a `forbidden` CommandError as
    soon as the broker says this client may not send there, instead of a timeout."""
    denials = _DENIALS.get(nc)
    return await call if denials is None else await _unless_denied(call, subject, denials)


async def _unless_denied(call: Awaitable[T], subject: str, denials: Denials) -> T:
    """The reply, or a `forbidden` CommandError as soon as the broker says this client may not send there."""
    denied = denials.watch(subject)
    task = asyncio.ensure_future(call)
    try:
        await asyncio.wait({task, denied}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise CommandError(
                "forbidden", f"forbidden by the broker: this identity may not send on {subject}"
            )
        return task.result()
    finally:
        denials.forget(subject, denied)
        if not task.done():
            task.cancel()
