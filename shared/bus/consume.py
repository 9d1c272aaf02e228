"""The durable consumer: one loop that fetches, hands a batch to its handler, and acks what the handler
applied, only after it returned (so after its transaction committed).

A handler of single messages (`Consumer(handler=...)`) is one of batches of one (`each`): each message
is applied and acked on its own, in the order fetched. A batch handler gets every message a fetch brought
at once, and the next fetch is already on its way while it applies them; after a small batch of more
than one message it lingers instead (`linger`), so that under load the next batch gathers. Either way a
message that cannot be decoded or verified is dead-lettered alone before the handler sees it; a batch
the handler fails on is split in halves until the failing message is alone, which is retried a few
times and then dead-lettered with the reason (while the database or broker is away, it is retried for
as long as it takes).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import nats.js.errors
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

from shared import metrics, telemetry
from shared.bus.deadletter import dead_letter
from shared.bus.errors import Reject, Retry
from shared.bus.pull import Pull
from shared.bus.wire import WIRE, settle
from shared.config import Settings
from shared.crash import crash_point
from shared.errors import transient
from shared.messages import BadMessage, Envelope, Model, decode, decode_one
from shared.topology import subjects

log = logging.getLogger(__name__)
ACK_WAIT: float = Settings.model_fields["ack_wait"].default
"""RACKPLANE_ACK_WAIT's default, for a consumer its service does not give one (the tests' own)."""


@dataclass
class Delivery:
    """One decoded message of a batch. The batch handler sets `refused` on a message it did not apply
    (a `Retry` to have it redelivered later, a `Reject` to dead-letter it); the others are acked."""

    env: Envelope
    body: Any
    msg: Msg
    refused: Retry | Reject | None = None


Handler = Callable[[Envelope, Any, Msg], Awaitable[None]]
BatchHandler = Callable[[list[Delivery]], Awaitable[None]]


def each(handler: Handler) -> BatchHandler:
    """A handler of single messages as a batch handler (of batches of one): the `Reject` or `Retry` it
    raises refuses its message."""

    async def handle(batch: list[Delivery]) -> None:
        for d in batch:
            try:
                await handler(d.env, d.body, d.msg)
            except (Reject, Retry) as r:
                d.refused = r

    return handle


class Consumer:
    """One durable pull consumer and its loop. Its handler must be idempotent: delivery is at least once.

    Give it `handler` (single messages, fetched `batch` = 64 at a time) or `batch_handler` (whole
    batches, up to `batch` = 1000)."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        service: str,
        stream: str,
        durable: str,
        filter_subject: str,
        handler: Handler | None = None,
        batch_handler: BatchHandler | None = None,
        expect: type[Model] | tuple[type[Model], ...] | None = None,
        max_deliver: int = 8,
        ack_wait: float = ACK_WAIT,
        batch: int | None = None,
        verify: Callable[[str, Any], str | None] | None = None,
        dead_letters: str | None = None,
        idle_wait: float = 1.0,
        caught_up: asyncio.Event | None = None,
        linger: float = 0.0,
    ) -> None:
        if handler is not None and batch_handler is None:
            batch_handler = each(handler)
        elif handler is not None or batch_handler is None:
            raise TypeError("a consumer takes a handler or a batch handler, one of them")
        self.js = js
        self.service = service
        self.stream = stream
        self.durable = durable
        self.filter_subject = filter_subject
        self.alone = handler is not None
        """Whether each message is applied (and acked) on its own, a batch of one."""
        self.batch_handler = batch_handler
        self.expect = expect
        self.max_deliver = max_deliver
        self.ack_wait = ack_wait
        """How long JetStream waits for an ack before redelivering: the service's RACKPLANE_ACK_WAIT, which it
        passes; when not given, the process's setting."""
        self.batch = batch or (64 if self.alone else 1000)
        self.verify = verify
        """Checks a valid message against its subject; a reason means it is dead-lettered unhandled."""
        self.dead_letters = dead_letters or durable
        """The consumer name its dead letters are filed under (`rp.dlq.<service>.<name>`): one name for the
        durables of all partitions of one stream."""
        self.idle_wait = idle_wait
        """Seconds a fetch waits for a first message. Messages end the wait at once; what it bounds is the
        broker's load from idle consumers (a pull request and a probe each time it runs out) and, after a
        broker restart, which forgets pending pulls, how long until this consumer asks again."""
        self.caught_up = caught_up
        """Set while no backlog waits for this consumer: its last batch had nothing stored behind it (what
        came since, a linger's worth at most, may wait unfetched); cleared while a backlog waits. Work that
        should come after this consumer's can wait on it."""
        self.linger = 0.0 if self.alone else linger
        """Seconds a batch handler waits before its next fetch after a batch that found company (more
        than one message, less than a quarter of `batch`, nothing more stored behind it): under load the
        next batch gathers meanwhile, and its transaction, fetch and acks serve more messages. A message
        that comes alone is applied at once and the next fetch is not held, so a lone request's path is
        never slowed. The service's RACKPLANE_BATCH_LINGER. A consumer that says when it has caught up
        lingers too, caught up meanwhile: a batch that lingers had nothing stored behind it, so what its
        waiters may miss is what came in the last linger, never a backlog (a steady trickle, 5,000 sleds'
        inventories, must not keep them waiting)."""
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
        """Fetch, handle, ack, for ever. A batch handler's next fetch is asked for before its batch is
        applied, unless the batch says to linger (`linger`); one message at a time, what was fetched
        already waits its turn, so it asks for no more."""
        sub: Pull | None = None
        ahead: asyncio.Future[list[Msg]] | None = None
        try:
            while True:
                linger = False
                try:
                    if sub is None:
                        sub = await self._subscribe()
                    if ahead is None:
                        ahead = asyncio.ensure_future(sub.fetch(self.batch, timeout=self.idle_wait))
                    msgs = await ahead
                    ahead = None
                    behind = bool(msgs) and msgs[-1].metadata.num_pending > 0
                    linger = self.linger > 0 and 1 < len(msgs) and small(len(msgs), self.batch) and not behind
                    if not self.alone and not linger:  # the next batch comes while this one is applied
                        ahead = asyncio.ensure_future(sub.fetch(self.batch, timeout=self.idle_wait))
                except TimeoutError:  # nothing to fetch
                    ahead = None
                    self._pending([])
                    self._caught_up(True)
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    if sub is not None:
                        await sub.close()
                    sub, ahead = None, None
                    self._caught_up(True)  # nothing waits on a consumer that cannot fetch
                    await self._fetch_failed(e)
                    continue
                self._pending(msgs)
                if behind:
                    self._caught_up(False)
                for group in [[m] for m in msgs] if self.alone else [msgs]:
                    await self._take(group)
                if not behind:  # what the prefetch brought meanwhile is a backlog too
                    self._caught_up(ahead is None or not _fetched(ahead))
                if linger:  # company: the next batch gathers meanwhile
                    await asyncio.sleep(self.linger)
        finally:
            if ahead is not None:
                ahead.cancel()
            if sub is not None:
                await sub.close()

    def _caught_up(self, caught_up: bool) -> None:
        if self.caught_up is not None:
            (self.caught_up.set if caught_up else self.caught_up.clear)()

    async def _fetch_failed(self, e: Exception) -> None:
        """The broker is restarting, the consumer is gone or the connection closed: say so, count it and
        wait a little; the caller subscribes anew."""
        log.warning("%s/%s: fetch failed (%s); retrying", self.service, self.durable, e)
        telemetry.count("fetch_errors", consumer=self.durable)
        await asyncio.sleep(0.5)

    async def _take(self, msgs: list[Msg]) -> None:
        """Admit `msgs` and apply those to be handled now; one to be handled later (`WIRE.later`) is
        applied alone, in a task of its own, once its wait is over."""
        now: list[Delivery] = []
        for msg in msgs:
            admitted = self._admit(msg)
            if isinstance(admitted, str):
                await self._dead_letter(msg, admitted)
                continue
            d = Delivery(*admitted, msg)
            if (wait := WIRE.later(msg)) is None:
                now.append(d)
                continue
            task = asyncio.create_task(self._later(wait, d))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if now:
            await self._apply(now)

    async def _later(self, wait: Awaitable[None], d: Delivery) -> None:
        await wait
        await self._apply([d])

    def _admit(self, msg: Msg) -> tuple[Envelope, Any] | str:
        """The message decoded and verified against its subject, or why it is to be dead-lettered."""
        try:
            if isinstance(self.expect, type):  # one model: envelope and body in one pass
                env, body = decode_one(msg.data, self.expect)
            else:
                env, body = decode(msg.data, self.expect)
        except BadMessage as e:
            return f"{e.code}: {e.reason}"
        if self.verify is not None and (refused := self.verify(msg.subject, body)):
            return refused
        return env, body

    async def _apply(self, batch: list[Delivery]) -> None:
        """Hand `batch` to the handler; then ack, hand back or dead-letter each message, as it says."""
        if self.alone or len(batch) == 1:  # a batch of one is that message's processing
            one = batch[0]
            size = len(one.msg.data or b"")
            attributes = {MESSAGING_MESSAGE_ID: str(one.env.id), MESSAGING_MESSAGE_BODY_SIZE: size}
        else:
            attributes = {MESSAGING_BATCH_MESSAGE_COUNT: len(batch)}
        try:
            with self._processing(batch[0].msg, **attributes):
                await self.batch_handler(batch)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self._not_applied(batch, e)
            return
        crash_point(f"after-commit:{self.durable}")
        if not self.alone:
            telemetry.count("batches", consumer=self.durable)
        handled = 0
        for d in batch:
            if isinstance(d.refused, Reject):
                await self._dead_letter(d.msg, d.refused.reason)
            elif isinstance(d.refused, Retry):
                telemetry.count("retried", consumer=self.durable)
                await settle(d.msg.nak(delay=d.refused.delay))
            elif await WIRE.ack(d.msg):
                handled += 1
        if handled:
            telemetry.count("handled", handled, consumer=self.durable)

    async def _not_applied(self, batch: list[Delivery], e: Exception) -> None:
        """The handler raised: retry while the infrastructure is away; split a batch to find the message
        it fails on; a message alone is retried a few times, then dead-lettered with the reason."""
        if transient(e):  # the database or broker is away: retried, for as long as it takes
            log.warning("%s/%s: handler waits for the infrastructure: %s", self.service, self.durable, e)
            telemetry.count("transient_errors", consumer=self.durable)
            for d in batch:
                await settle(d.msg.nak(delay=min(0.1 * 2**d.msg.metadata.num_delivered, 2.0)))
            return
        if len(batch) > 1:
            log.warning(
                "%s/%s: batch of %d failed (%s); splitting it", self.service, self.durable, len(batch), e
            )
            telemetry.count("batch_splits", consumer=self.durable)
            half = len(batch) // 2
            await self._apply(batch[:half])
            await self._apply(batch[half:])
            return
        msg = batch[0].msg
        delivered = msg.metadata.num_delivered
        log.error("%s/%s: handler failed (delivery %d)", self.service, self.durable, delivered, exc_info=e)
        if delivered >= self.max_deliver:
            await self._dead_letter(msg, f"handler failed {delivered} times: {type(e).__name__}: {e}")
        else:
            await settle(msg.nak(delay=min(0.1 * 2**delivered, 5.0)))

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        await dead_letter(
            self.js,
            msg,
            reason,
            service=self.service,
            stream=self.stream,
            durable=self.durable,
            filed_as=self.dead_letters,
        )

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


def small(n: int, batch: int) -> bool:
    """Whether `n` messages are few enough of a full `batch` to linger after (consumers and outbox relays
    alike): under a quarter; a larger batch has a backlog behind it, and what comes next goes at once."""
    return n < batch // 4


def _fetched(fetch: asyncio.Future[list[Msg]]) -> bool:
    """Whether a fetch has finished and brought messages (not an error, not nothing)."""
    return fetch.done() and not fetch.cancelled() and fetch.exception() is None and bool(fetch.result())
