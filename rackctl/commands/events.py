"""`rackctl events follow`: the durable events (stream EVENTS), as they happen, like `kubectl get -w`.

It reads through short-lived consumers of its own (`follow`): named, with the filter in the create subject,
so that the broker holds a silo's operator to `rp.evt.<silo>.>` (deploy/identities.py, `follow_events`),
and without acks, since it only watches. If the consumer is lost (the broker restarted, the connection was
away longer than its inactivity limit) a new one starts from the event after the last one shown, so
nothing is skipped and nothing shown twice. With a subscriber's context it reads the subscriber's own
stream (`EVENTS-<name>`), within its scope; `--durable` then reads through the subscriber's durable
consumer of its own name, acking each event once shown, so the next run resumes after it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import uuid
from collections import deque
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from rackctl import context as contexts
from rackctl.commands.args import ago, count, silo_path
from rackctl.commands.base import Invocation, UsageError, command, group
from shared import bus
from shared.messages import InstanceList
from shared.topology import jsapi, subjects

INACTIVE = 30.0
"""Seconds the broker keeps a follower's consumer once nobody pulls from it (so one left by a killed
rackctl goes away by itself)."""
HEADERS = ("TIME", "SILO", "EVENT", "NAME", "STATE", "GENERATION")
WIDTHS = (24, 12, 20, 36, 10, 0)
"""Fixed column widths, since the rows come one at a time (a wider cell pushes its own line along)."""

group("events", "the durable events of the control plane (stream EVENTS)")


StartAt = datetime | int | None
"""Where a reader starts: a time, a stream sequence, or (None) the next event."""


def start_point(text: str) -> datetime | int:
    """`--from`: a stream sequence (a whole number) or a time (RFC 3339, `2026-12-06T10:00:00Z`)."""
    if text.isdigit() and int(text) > 0:
        return int(text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid start {text!r}: expected a stream sequence (1, 2, ...) or a time such as "
            "2026-12-06T10:00:00Z"
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _start(config: api.ConsumerConfig, at: StartAt) -> None:
    if isinstance(at, int):
        config.deliver_policy, config.opt_start_seq = api.DeliverPolicy.BY_START_SEQUENCE, at
    elif at is not None:
        config.deliver_policy, config.opt_start_time = api.DeliverPolicy.BY_START_TIME, at
    else:
        config.deliver_policy = api.DeliverPolicy.NEW


async def _consumer(
    js: JetStreamContext, stream: str, filter_subject: str, at: StartAt, durable: str | None, first: bool
) -> JetStreamContext.PullSubscription:
    """A reader's consumer: a durable of that name, bound if it exists (it resumes where it acked), else
    made starting at `at`; or a fresh one that only watches, and goes away once nobody pulls."""
    if durable is not None:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await bus.unless_denied(
                js._nc, jsapi.consumer("INFO", stream, durable), js.consumer_info(stream, durable)
            )
            if at is not None and first:  # asked for a start it will not get
                print(f"durable {durable} exists: it resumes where it acked, not at --from", file=sys.stderr)
            return await js.pull_subscribe_bind(consumer=durable, stream=stream)
    name = durable or f"follow-{uuid.uuid4().hex[:16]}"
    config = api.ConsumerConfig(name=name, filter_subject=filter_subject)
    if durable is None:
        config.ack_policy, config.inactive_threshold = api.AckPolicy.NONE, INACTIVE
        config.mem_storage, config.num_replicas = True, 1
    else:
        config.durable_name, config.ack_policy = durable, api.AckPolicy.EXPLICIT
    _start(config, at)
    create = jsapi.consumer_create(stream, name, filter_subject)
    await bus.unless_denied(js._nc, create, js.add_consumer(stream, config))
    return await js.pull_subscribe_bind(consumer=name, stream=stream)


async def follow(
    js: JetStreamContext,
    filter_subject: str,
    *,
    since: StartAt = None,
    stream: str = subjects.EVENTS_STREAM,
    durable: str | None = None,
    batch: int = 64,
) -> AsyncIterator[Msg]:
    """Every event under `filter_subject` from now (or from `since`: a time or a sequence), in stream
    order, for as long as the caller iterates; through the durable `durable` if given (the caller acks).
    A consumer that goes away is replaced, from the sequence after the last event given. `batch` bounds
    what one pull holds: a durable's events pulled but not acked come again only after its ack wait."""
    next_seq: int | None = None
    first = True
    while True:
        try:
            at = next_seq if next_seq is not None else since
            sub = await _consumer(js, stream, filter_subject, at, durable, first)
        except (nats.errors.TimeoutError, nats.errors.ConnectionReconnectingError):
            if first:
                raise
            await asyncio.sleep(0.5)  # the broker is away: try again until it is back
            continue
        first = False
        while True:
            try:
                msgs = await sub.fetch(batch, timeout=1.0)
            except TimeoutError:  # no event yet (nats-py raises a subclass of it, or a bare one)
                continue
            except (nats.errors.Error, nats.js.errors.Error):
                break  # the consumer is gone or the connection dropped: a new one, from where we were
            for msg in msgs:
                next_seq = msg.metadata.sequence.stream + 1
                yield msg
        await asyncio.sleep(0.5)


LOOKUP_EVERY = 5.0
"""Seconds between two lookups of one silo's names: an id no lookup finds (a deleted instance) stays an id
rather than costing a request per event."""


class Names:
    """Instance (`project/name`) and project names by id, for the NAME column of events that carry only
    ids (provision outcomes, usage changes): learnt from every instance event shown, else from the silo's
    instance list, asked at most every LOOKUP_EVERY seconds. A context that may not list (a subscriber's)
    or a list that fails leaves the id as it is: the column is a courtesy, never an error."""

    def __init__(self, ctx: Invocation) -> None:
        self.ctx = ctx
        self.known: dict[str, str] = {}
        self.asked: dict[str, float] = {}
        self.off = False

    def learn(self, view: dict[str, Any]) -> None:
        if view.get("id") and view.get("project") and view.get("name"):
            self.known[str(view["id"])] = f"{view['project']}/{view['name']}"
        if view.get("project_id") and view.get("project"):
            self.known[str(view["project_id"])] = str(view["project"])

    async def fill(self, silo: str, data: dict[str, Any]) -> None:
        """Make sure the ids `data` names are known, if a lookup can tell."""
        if isinstance(data.get("instance"), dict):
            self.learn(data["instance"])
            return
        wanted = [str(data[k]) for k in ("instance_id", "project_id") if data.get(k)]
        if self.off or all(w in self.known for w in wanted) or not wanted:
            return
        now = asyncio.get_running_loop().time()
        if now - self.asked.get(silo, -LOOKUP_EVERY) < LOOKUP_EVERY:
            return
        self.asked[silo] = now
        try:
            client = await self.ctx.client()
            async with asyncio.timeout(2.0):
                views = await client.every(InstanceList(silo=silo))
        except bus.CommandError as e:
            self.off = e.code == "forbidden"  # this context may only follow (a subscriber's): ask no more
            return
        except (TimeoutError, nats.errors.Error):
            return
        for v in views:
            self.learn(v)


def row(msg: Msg, names: dict[str, str] | None = None) -> tuple[Any, ...]:
    """One event as a table row. Read tolerantly, as any event reader does: a field it does not know is
    ignored, a schema it does not know still shows its subject. An id is shown as its name when `names`
    has it."""
    names = names or {}
    when = msg.metadata.timestamp.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"
    silo, event, _ = subjects.parse_event(msg.subject)  # every version of a schema: the same change
    try:
        data = json.loads(msg.data)["data"]
    except (ValueError, KeyError, TypeError):
        return (when, silo, event, "(not a readable envelope)", None, None)
    name: Any = None
    state: Any = None
    generation: Any = None
    if "instance" in data and isinstance(data["instance"], dict):
        v = data["instance"]
        name, state, generation = f"{v.get('project')}/{v.get('name')}", v.get("state"), v.get("generation")
    elif "pool" in data and isinstance(data["pool"], dict):
        v = data["pool"]
        name, state = f"{v.get('project')}/{v.get('name')}", data.get("change")
    elif "sled" in data and isinstance(data["sled"], dict):
        v = data["sled"]
        name, state, generation = v.get("id"), v.get("state"), v.get("boot_number")
    elif "outcome" in data:
        iid = data.get("instance_id")
        name, state, generation = names.get(str(iid), iid), data.get("outcome"), data.get("generation")
    elif event.endswith((".created", ".deleted")):
        name, state = data.get("name"), event.rsplit(".", 1)[-1]
    elif "project_id" in data:
        name = names.get(str(data.get("project_id")), data.get("project_id"))
    return (when, silo, event, name, state, generation)


def line(cells: tuple[Any, ...]) -> str:
    text = ("-" if c is None else str(c) for c in cells)
    return "  ".join(c.ljust(w) for c, w in zip(text, WIDTHS, strict=True)).rstrip()


def as_json(msg: Msg) -> dict[str, Any]:
    try:
        envelope = json.loads(msg.data)
    except ValueError:
        envelope = None
    return {
        "seq": msg.metadata.sequence.stream,
        "subject": msg.subject,
        "time": msg.metadata.timestamp.astimezone(UTC).isoformat(),
        "event": envelope,
    }


def _follow_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--silo", type=silo_path, metavar="SILO", help="only this silo's events")
    start = p.add_mutually_exclusive_group()
    start.add_argument(
        "--since", type=ago, metavar="AGO", help="start this long ago (30s, 10m, 2h, 7d): default now"
    )
    start.add_argument(
        "--from",
        dest="start",
        type=start_point,
        metavar="TIME|SEQ",
        help="start at this time (2026-12-06T10:00:00Z) or stream sequence: default now",
    )
    p.add_argument(
        "--durable",
        action="store_true",
        help="a subscriber's context: read through its durable of its own name, acking each event shown; "
        "the next run resumes after the last one",
    )
    p.add_argument("--count", type=count, metavar="N", help="stop after N events (default: until Ctrl-C)")
    p.add_argument(
        "--json", action="store_true", help="one JSON object per line: {seq, subject, time, event}"
    )


@command(
    "events follow",
    "print the events as they happen, until Ctrl-C",
    _follow_args,
    examples=(
        "rackctl events follow",
        "rackctl events follow --silo acme --since 10m  # acme's, from ten minutes ago",
        "rackctl events follow --count 5 --json",
        "rackctl --context billing events follow --durable --from 1  # a subscriber's, from its first event",
    ),
)
async def events_follow(ctx: Invocation) -> None:
    a = ctx.args
    current = contexts.load(a.context)
    stream = (current.stream if current else None) or subjects.EVENTS_STREAM
    if a.durable and not (current and current.stream and current.identity):
        raise UsageError("--durable reads a subscriber's own durable: use a subscriber's context")
    durable = current.identity if a.durable and current else None
    js = (await ctx.client()).nc.jetstream()
    since: StartAt = datetime.now(UTC) - timedelta(seconds=a.since) if a.since else a.start
    silo = a.silo or (current.silo if current else None)
    if not a.json:
        print(line(HEADERS), flush=True)
    shown = 0
    recent: deque[tuple[Any, ...]] = deque(maxlen=256)
    names = Names(ctx)
    batch = min(64, a.count) if a.count else 64
    pattern = subjects.event_pattern(silo)
    async for msg in follow(js, pattern, since=since, stream=stream, durable=durable, batch=batch):
        if a.json:
            text = json.dumps(as_json(msg), sort_keys=True)
        else:
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError, IndexError):
                await names.fill(subjects.silo_of(msg.subject), json.loads(msg.data)["data"])
            cells = row(msg, names.known)
            if cells[1:] in recent:  # the same change in another version of its schema (docs/subjects.md)
                continue
            recent.append(cells[1:])
            text = line(cells)
        print(text, flush=True)
        if durable:
            await msg.ack()
        shown += 1
        if a.count is not None and shown >= a.count:
            return
