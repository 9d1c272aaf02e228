"""`rackctl events follow`: the durable events (stream EVENTS), as they happen, like `kubectl get -w`.

It reads through short-lived consumers of its own (`follow`): named, with the filter in the create subject,
so that the broker holds a silo's operator to `rp.evt.<silo>.>` (deploy/identities.py, `follow_events`),
and without acks, since it only watches. If the consumer is lost (the broker restarted, the connection was
away longer than its inactivity limit) a new one starts from the event after the last one shown, so
nothing is skipped and nothing shown twice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import uuid
from collections import deque
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from rackctl.commands.args import ago, count, silo_path
from rackctl.commands.base import Ctx, command, group
from shared import bus, subjects
from shared.messages import InstanceList

INACTIVE = 30.0
"""Seconds the broker keeps a follower's consumer once nobody pulls from it (so one left by a killed
rackctl goes away by itself)."""
HEADERS = ("TIME", "SILO", "EVENT", "NAME", "STATE", "GENERATION")
WIDTHS = (24, 12, 20, 36, 10, 0)
"""Fixed column widths, since the rows come one at a time (a wider cell pushes its own line along)."""

group("events", "the durable events of the control plane (stream EVENTS)")


async def follow(
    js: JetStreamContext, filter_subject: str, *, since: datetime | None = None
) -> AsyncIterator[Msg]:
    """Every event under `filter_subject` from now (or from `since`), in stream order, for as long as the
    caller iterates. A consumer that goes away is replaced, from the sequence after the last event given."""
    next_seq: int | None = None
    first = True
    while True:
        name = f"follow-{uuid.uuid4().hex[:16]}"
        config = api.ConsumerConfig(
            name=name,
            filter_subject=filter_subject,
            ack_policy=api.AckPolicy.NONE,
            inactive_threshold=INACTIVE,
            mem_storage=True,
            num_replicas=1,
        )
        if next_seq is not None:
            config.deliver_policy, config.opt_start_seq = api.DeliverPolicy.BY_START_SEQUENCE, next_seq
        elif since is not None:
            config.deliver_policy, config.opt_start_time = api.DeliverPolicy.BY_START_TIME, since
        else:
            config.deliver_policy = api.DeliverPolicy.NEW
        create = f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}.{name}.{filter_subject}"
        try:
            await bus.unless_denied(js._nc, create, js.add_consumer(subjects.EVENTS_STREAM, config))
            sub = await js.pull_subscribe_bind(consumer=name, stream=subjects.EVENTS_STREAM)
        except (nats.errors.TimeoutError, nats.errors.ConnectionReconnectingError):
            if first:
                raise
            await asyncio.sleep(0.5)  # the broker is away: try again until it is back
            continue
        first = False
        while True:
            try:
                msgs = await sub.fetch(64, timeout=1.0)
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

    def __init__(self, ctx: Ctx) -> None:
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
            views = await asyncio.wait_for(client.every(InstanceList(silo=silo)), 2.0)
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
    tokens = msg.subject.split(".")
    if re.fullmatch(r"v\d+", tokens[-1]):  # a later version of the schema: the same change, shown once
        tokens = tokens[:-1]
    silo, event = tokens[2], ".".join(tokens[3:])
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
    elif event.endswith(".created"):
        name, state = data.get("name"), "created"
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
    p.add_argument(
        "--since", type=ago, metavar="AGO", help="start this long ago (30s, 10m, 2h, 7d): default now"
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
    ),
)
async def events_follow(ctx: Ctx) -> None:
    a = ctx.args
    js = (await ctx.client()).nc.jetstream()
    since = datetime.now(UTC) - timedelta(seconds=a.since) if a.since else None
    if not a.json:
        print(line(HEADERS), flush=True)
    shown = 0
    recent: deque[tuple[Any, ...]] = deque(maxlen=256)
    names = Names(ctx)
    async for msg in follow(js, subjects.event_pattern(a.silo), since=since):
        if a.json:
            text = json.dumps(as_json(msg), sort_keys=True)
        else:
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError, IndexError):
                await names.fill(msg.subject.split(".")[2], json.loads(msg.data)["data"])
            cells = row(msg, names.known)
            if cells[1:] in recent:  # the same change in another version of its schema (docs/subjects.md)
                continue
            recent.append(cells[1:])
            text = line(cells)
        print(text, flush=True)
        shown += 1
        if a.count is not None and shown >= a.count:
            return
