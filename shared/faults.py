"""Fault injection in the bus: what chaos tests and operators turn on to see the invariants hold anyway.

One `Faults` object per process (`FAULTS`), off by default. Only a process started with RACKPLANE_FAULTS
takes it: `install` then puts wrappers on the bus's contact points with the broker (shared/bus/wire.py:
storing and posting a message, the outbox relay's bulk publish, acking a delivery, handling one,
answering a request), and the bus itself knows nothing of faults. Faults act there only, on messages in
flight, never on what a handler decides. They are switched at run time through
`rp.svc.<service>.faults` (`shared.service.serve_faults`, `rackctl chaos`), and every fault injected is
counted in `telemetry.COUNTERS` under `faults.<type>`, so a test can tell that the fault really happened.

Outgoing JetStream messages (`bus.publish`, and the outbox relay's `BulkPublisher`) can be
- delayed: each by a time drawn from [min, max] (the sender waits for its ack that much longer);
- duplicated: sent N more times, each copy a little later, with the same Nats-Msg-Id (the broker drops
  it inside its window) or, with `bypass_dedupe`, an id of its own (the consumers must drop it);
- reordered: held until W are held (or the oldest waited T seconds), then released shuffled;
- refused on a first attempt: the first publish of each message fails with `InjectedFault`, so what
  arrives is the sender's retry (the outbox relay, saga steps and the sled reporter all retry). A message
  is known by its subject and content (schema, version, data; not its id or time), because the sled
  reporter gives each retry a new id.

Consumed messages (`bus.Consumer`) can have
- their ack held back (the next K, then each with probability p): JetStream redelivers after ack_wait;
- a slow handler: the first delivery sleeps S seconds before it is handled, alone, in a task of its own
  (the consumer goes on with the rest), so that with S longer than ack_wait the redelivery is fetched
  and handled *while the first delivery is still on its way to its handler*; the redelivery runs at
  once and normally wins, the first delivery is handled later and must find nothing left to do. Only
  first deliveries are slowed, so the pair always ends.

Requests a service answers (commands, `bus.serve`) can be
- handled twice: a duplicate of the request, as a sender's retry would make (the second reply is dropped);
- answered late: the reply held for up to S seconds;
- left unanswered: the reply dropped, so that the requester times out (and may ask again).

A subject-prefix filter (`only`) confines every fault to the subjects it names. Stats and fault requests
(`rp.svc.*`), dead letters and the sled simulator's own faults (`rp.sim.faults.set`) are untouched.
The settings live in the process: a restarted service starts with none.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from shared import telemetry
from shared.bus import wire
from shared.bus.publish import BulkPublisher
from shared.bus.wire import WIRE, Bulk
from shared.messages import Reply, ServiceFaults
from shared.topology import subjects

log = logging.getLogger(__name__)

MSG_ID = api.Header.MSG_ID.value
REMEMBERED = 100_000
"""How many messages the first-attempt fault remembers having refused once."""


class InjectedFault(Exception):
    """A publish the fault layer failed on purpose: transient, so a sender that retries sends it again."""


@dataclass
class _Outgoing:
    js: JetStreamContext
    subject: str
    payload: bytes
    headers: dict[str, str]
    done: asyncio.Future[api.PubAck] | None
    """The sender's future for the original; None for an injected copy, which nobody waits for."""


class Faults:
    """The faults this process injects, and the messages they hold (reorder window, delayed sends)."""

    def __init__(self) -> None:
        self.active = False
        self._outgoing = False
        """Whether a fault applies to outgoing messages (otherwise they go straight out, even when active)."""
        self.settings = ServiceFaults()
        self.rng = random.Random()
        self._attempted: OrderedDict[str, None] = OrderedDict()
        self._window: list[_Outgoing] = []
        self._window_epoch = 0
        self._release_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._slowed_now = 0

    # --- control ---

    def configure(self, body: ServiceFaults) -> None:
        """Apply a `rp.svc.faults` request: `clear` first, then every field that is not null."""
        if body.clear:
            self.settings = ServiceFaults()
            self._attempted.clear()
        changes = {name: value for name, value in body if name != "clear" and value is not None}
        self.settings = self.settings.model_copy(update=changes)
        if body.seed is not None:
            self.rng.seed(body.seed)
        self._refresh()
        if not self._reordering() and self._window:
            self._spawn(self._release(self._take_window()))

    def describe(self) -> dict[str, Any]:
        """The current settings, what was injected so far (counters survive `clear`), and how many first
        deliveries sleep in a slow handler right now (a test sees a redelivery overtake one)."""
        return {
            "active": self.active,
            "faults": self.settings.model_dump(mode="json", exclude={"clear"}),
            "counters": {k: v for k, v in telemetry.COUNTERS.items() if k.startswith("faults.")},
            "slow_handlers_running": self._slowed_now,
        }

    def _refresh(self) -> None:
        """Recompute the two flags the bus checks, from the settings."""
        s = self.settings
        self._outgoing = bool(
            (s.delay and s.delay.max_seconds)
            or (s.duplicate and s.duplicate.copies)
            or self._reordering()
            or s.drop_first_attempt
        )
        consuming = (s.hold_acks and (s.hold_acks.count or s.hold_acks.probability)) or s.slow_handler_seconds
        r = s.requests
        answering = r and (r.duplicate_probability or r.delay_reply_seconds or r.drop_reply_probability)
        self.active = bool(self._outgoing or consuming or answering)

    def targets(self, subject: str) -> bool:
        only = self.settings.only
        return not only or any(subject.startswith(prefix) for prefix in only)

    def _faults_outgoing(self, subject: str) -> bool:
        return self._outgoing and self.targets(subject)

    def faults_any_outgoing(self, subjects: Iterable[str]) -> bool:
        """Whether a fault applies to publishing on any of `subjects` (the others need not go through it)."""
        return self._outgoing and any(self.targets(s) for s in subjects)

    # --- outgoing messages ---

    async def publish(
        self, js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str]
    ) -> api.PubAck:
        """`js.publish` with the faults that apply to `subject`: returns once JetStream acked it."""
        if not self._faults_outgoing(subject):
            return await js.publish(subject, payload, headers=headers)
        return await (await self.publish_async(js, subject, payload, headers))

    async def publish_async(
        self, js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str]
    ) -> asyncio.Future[api.PubAck]:
        """`js.publish_async` with the faults that apply to `subject`: a future for JetStream's ack."""
        if not self._faults_outgoing(subject):
            return await js.publish_async(subject, payload, headers=headers)
        s = self.settings
        if s.drop_first_attempt and self._first_attempt(subject, payload):
            telemetry.count("faults.drop_first_attempt")
            raise InjectedFault(f"fault injection: first attempt of a message on {subject} refused")
        done: asyncio.Future[api.PubAck] = asyncio.get_running_loop().create_future()
        done.add_done_callback(_retrieve)
        delay = self._delay()
        if delay:
            telemetry.count("faults.delay")
        self._spawn(self._send(_Outgoing(js, subject, payload, headers, done), delay))
        dup = s.duplicate
        for k in range(1, (dup.copies if dup else 0) + 1):
            assert dup is not None
            copy = dict(headers)
            if dup.bypass_dedupe:
                copy[MSG_ID] = f"{headers.get(MSG_ID, '')}:fault-copy-{k}-{uuid.uuid4().hex[:8]}"
            telemetry.count("faults.duplicate")
            later = delay + dup.copy_delay_seconds * k
            self._spawn(self._send(_Outgoing(js, subject, payload, copy, None), later))
        return done

    def _delay(self) -> float:
        d = self.settings.delay
        return self.rng.uniform(d.min_seconds, d.max_seconds) if d and d.max_seconds else 0.0

    def _first_attempt(self, subject: str, payload: bytes) -> bool:
        key = _identity(subject, payload)
        if key in self._attempted:
            return False
        self._attempted[key] = None
        while len(self._attempted) > REMEMBERED:
            self._attempted.popitem(last=False)
        return True

    async def _send(self, out: _Outgoing, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        if self._reordering():
            self._hold(out)
        else:
            await self._deliver(out)

    async def _deliver(self, out: _Outgoing) -> None:
        try:
            ack = await out.js.publish(out.subject, out.payload, headers=out.headers)
        except Exception as e:
            if out.done is None:
                log.info("fault injection: a copy on %s was not sent: %s", out.subject, e)
            elif not out.done.done():
                out.done.set_exception(e)
            return
        if out.done is not None and not out.done.done():
            out.done.set_result(ack)

    # --- the reorder window ---

    def _reordering(self) -> bool:
        r = self.settings.reorder
        return bool(r and r.window)

    def _hold(self, out: _Outgoing) -> None:
        reorder = self.settings.reorder
        assert reorder is not None
        self._window.append(out)
        if len(self._window) >= reorder.window:
            self._spawn(self._release(self._take_window()))
        elif len(self._window) == 1:
            self._spawn(self._release_after(self._window_epoch, reorder.max_hold_seconds))

    def _take_window(self) -> list[_Outgoing]:
        held, self._window = self._window, []
        self._window_epoch += 1
        return held

    async def _release_after(self, epoch: int, seconds: float) -> None:
        await asyncio.sleep(seconds)
        if epoch == self._window_epoch and self._window:
            await self._release(self._take_window())

    async def _release(self, held: list[_Outgoing]) -> None:
        """Publish a window's messages one by one, shuffled (never in the order they came in)."""
        order = held[:]
        self.rng.shuffle(order)
        if len(order) > 1 and all(a is b for a, b in zip(order, held, strict=True)):
            order = order[1:] + order[:1]
        moved = sum(a is not b for a, b in zip(order, held, strict=True))
        if moved:
            telemetry.count("faults.reorder", moved)
        async with self._release_lock:  # one window at a time, so the broker stores them in this order
            for out in order:
                await self._deliver(out)

    # --- requests answered ---

    def _request_fault(self, subject: str) -> Any:
        r = self.settings.requests
        if r is None or subjects.is_service_control(subject) or not self.targets(subject):
            return None
        return r

    def duplicates_request(self, subject: str) -> bool:
        r = self._request_fault(subject)
        if r is None or not (r.duplicate_probability and self.rng.random() < r.duplicate_probability):
            return False
        telemetry.count("faults.duplicate_request")
        return True

    async def before_reply(self, subject: str) -> bool:
        """Hold the reply (a delay fault) and say whether to send it at all (a drop fault)."""
        r = self._request_fault(subject)
        if r is None:
            return True
        if r.delay_reply_seconds:
            telemetry.count("faults.delay_reply")
            await asyncio.sleep(self.rng.uniform(0, r.delay_reply_seconds))
        if r.drop_reply_probability and self.rng.random() < r.drop_reply_probability:
            telemetry.count("faults.drop_reply")
            return False
        return True

    # --- consumed messages ---

    def slows(self, msg: Msg) -> bool:
        """A first delivery the slow-handler fault delays (the consumer handles it in its own task)."""
        return bool(self.settings.slow_handler_seconds) and self.targets(msg.subject) and _first(msg)

    async def before_handler(self, msg: Msg) -> None:
        if self.slows(msg):
            telemetry.count("faults.slow_handler")
            self._slowed_now += 1
            try:
                await asyncio.sleep(self.settings.slow_handler_seconds or 0)
            finally:
                self._slowed_now -= 1

    def holds_ack(self, msg: Msg) -> bool:
        """Whether to leave a handled message unacked, so that JetStream redelivers it after ack_wait."""
        hold = self.settings.hold_acks
        if hold is None or not self.targets(msg.subject):
            return False
        if hold.count > 0:
            left = hold.model_copy(update={"count": hold.count - 1})
            self.settings = self.settings.model_copy(update={"hold_acks": left})
            self._refresh()
        elif not (hold.probability and self.rng.random() < hold.probability):
            return False
        telemetry.count("faults.hold_ack")
        return True

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _identity(subject: str, payload: bytes) -> str:
    """What makes a message the same message again: its subject and content, not its id or time."""
    try:
        env = json.loads(payload)
        content = json.dumps([env.get("schema"), env.get("version"), env.get("data")], sort_keys=True)
    except (ValueError, AttributeError):
        content = payload.hex()
    return hashlib.sha256(f"{subject}\n{content}".encode()).hexdigest()


def _first(msg: Msg) -> bool:
    try:
        return msg.metadata.num_delivered == 1
    except Exception:  # not a JetStream message
        return False


def _retrieve(future: asyncio.Future[Any]) -> None:
    """A sender that gave up on its ack (the relay's timeout) must not leave an unretrieved exception."""
    if not future.cancelled():
        future.exception()


FAULTS = Faults()
"""This process's faults. Off until `rp.svc.<service>.faults` turns something on."""


def install() -> None:
    """Put `FAULTS` on the bus's contact points with the broker (shared/bus/wire.py), once: a process
    started with RACKPLANE_FAULTS does this before it serves its faults subject. Each wrapper is the plain
    call while no fault is switched on."""
    if WIRE.installed is FAULTS:
        return
    WIRE.store, WIRE.post, WIRE.store_all = _store, _post, _store_all
    WIRE.ack, WIRE.later, WIRE.answer = _ack, _later, _answer
    WIRE.installed = FAULTS


async def _store(js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str]) -> api.PubAck:
    if FAULTS.active:
        return await FAULTS.publish(js, subject, payload, headers)
    return await wire.store(js, subject, payload, headers)


async def _post(nc: NATS, subject: str, payload: bytes, headers: dict[str, str]) -> None:
    if FAULTS.active:  # faults apply to what is posted too: through JetStream's publish, acked
        await FAULTS.publish(nc.jetstream(), subject, payload, headers)
    else:
        await wire.post(nc, subject, payload, headers)


async def _store_all(publisher: BulkPublisher, messages: Bulk, timeout: float) -> None:
    """The relay's publish through the fault layer when a fault applies to one of its subjects (it may
    delay, copy, reorder or refuse them: the rows stay until their acks, so a refused or lost publish is
    sent again by a later drain)."""
    if not FAULTS.faults_any_outgoing(subject for subject, _, _ in messages):
        return await wire.store_all(publisher, messages, timeout)
    js = publisher.nc.jetstream()
    acks = [await FAULTS.publish_async(js, *m) for m in messages]
    async with asyncio.timeout(timeout):
        await asyncio.gather(*acks)


async def _ack(msg: Msg) -> bool:
    if FAULTS.active and FAULTS.holds_ack(msg):  # held back: JetStream redelivers it after ack_wait
        return False
    return await wire.ack(msg)


def _later(msg: Msg) -> Awaitable[None] | None:
    return FAULTS.before_handler(msg) if FAULTS.active and FAULTS.slows(msg) else None


async def _answer(msg: Msg, reply: Reply, again: Callable[[], None]) -> None:
    if FAULTS.active and FAULTS.duplicates_request(msg.subject):
        again()  # the same request again, as a sender's retry would come; its reply dropped
    if msg.reply and (not FAULTS.active or await FAULTS.before_reply(msg.subject)):
        await wire.respond(msg, reply)
