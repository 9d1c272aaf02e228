"""What the operator was told, held against the rack at rest: every command that got an ok reply has its
effect (`no_acknowledged_command_lost`), whatever machine was lost meanwhile. The chaos soak keeps the
commands it sent as `Sent`; the records are read with acknowledged.sql, the instances' histories from
their `instance.changed` events."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from nats.js import JetStreamContext

from rackctl import stored
from shared.db import queries
from shared.messages import BadMessage, InstanceChanged, InstanceChangedV2, decode
from shared.topology import subjects

Q = queries(Path(__file__).with_suffix(".sql"))


@dataclass(frozen=True)
class Sent:
    """A command an operator sent, and what came of it: an ok reply (`acked`, with the state and generation
    it gave, for an instance), or no reply at all (not `acked`: it may or may not have run). A command
    refused with an answer did nothing and is not kept, unless a copy of it may have run where no record
    of it was kept (a replica of a release before command records): then it is kept as not `acked`."""

    seq: int
    """The order in which the commands were sent."""
    verb: str
    """One of VERBS."""
    silo: str
    project: str | None
    name: str
    """The silo's, the project's or the instance's name."""
    acked: bool
    state: str | None = None
    generation: int | None = None

    def line(self) -> str:
        told = f"answered {self.state} at generation {self.generation}" if self.state else "answered ok"
        where = "/".join(x for x in (self.silo, self.project) if x and x != self.name)
        return f"{self.verb} {where + '/' if where else ''}{self.name} (#{self.seq}, {told})"


VERBS = ("silo create", "project create", "instance create", "instance delete", "instance start",
         "instance stop")  # fmt: skip
ENDED = ("stopped", "failed", "destroyed")
"""The states in which a stop has ended (a VMM that failed or an instance deleted meanwhile ended too)."""


async def no_acknowledged_command_lost(
    conn: asyncpg.Connection, js: JetStreamContext, sent: Sequence[Sent]
) -> list[str]:
    """At rest, every command that got an ok reply has its effect: whatever machine was lost meanwhile, what
    the operator was told stays true.

    - a silo or project created exists;
    - an instance created (or picked from a pool) exists, unless a delete of it was sent (a delete without
      a reply may have run); one answered `creating` (its saga still running) has a record, live or not;
    - an instance deleted is gone (no live instance of its name);
    - an instance whose reply gave generation G has a record at generation G or later (a change the
      operator saw is never rolled back);
    - a start answered `running` at G ran: the instance's history (its `instance.changed` events, which
      its transactions publish through the outbox) shows it running at G or later; one answered
      `starting` at G came to an end: running, stopped, failed or destroyed after G;
    - a stop answered `stopping` or `stopped` at G ended: its history shows it stopped, failed or
      destroyed at G or later."""
    acked = [s for s in sent if s.acked]
    deleting = {(s.silo, s.project, s.name) for s in sent if s.verb == "instance delete"}
    silos = {r["name"] for r in await conn.fetch(Q["live_silos"])}
    projects = {(r["silo"], r["name"]) for r in await conn.fetch(Q["live_projects"])}
    records: dict[tuple[str, str | None, str], list[Any]] = collections.defaultdict(list)
    for r in await conn.fetch(
        Q["instances_of_silos"], sorted({s.silo for s in acked if s.verb.startswith("instance")})
    ):
        records[r["silo"], r["project"], r["name"]].append(r)
    history = await _instance_history(
        js, {s.silo for s in acked if s.verb in ("instance start", "instance stop")}
    )
    out = []
    for s in acked:
        key = (s.silo, s.project, s.name)
        mine = records.get(key, [])
        live = [r for r in mine if r["state"] != "destroyed"]
        if s.verb == "silo create":
            out += [f"{s.line()}: no such silo"] if s.name not in silos else []
            continue
        if s.verb == "project create":
            out += [f"{s.line()}: no such project"] if (s.silo, s.name) not in projects else []
            continue
        if not mine:
            out.append(f"{s.line()}: no record of the instance")
            continue
        if s.verb == "instance create" and not live and key not in deleting and s.state != "creating":
            out.append(f"{s.line()}: destroyed, and no delete of it was sent")
        elif s.verb == "instance delete" and live:
            out.append(f"{s.line()}: still {live[0]['state']}")
        if s.generation is None:
            continue
        if (had := max(r["generation"] for r in mine)) < s.generation:
            out.append(f"{s.line()}: its record is at generation {had}, before what the reply gave")
            continue
        seen = [h for r in mine for h in history.get(str(r["id"]), [])]
        if s.verb == "instance start" and s.state == "running":
            if not any(g >= s.generation and st == "running" for g, st in seen):
                out.append(f"{s.line()}: its history shows it running at no generation from then on")
        elif s.verb == "instance start" and s.state == "starting":
            if not any(g > s.generation and st in ("running", *ENDED) for g, st in seen):
                out.append(f"{s.line()}: its history shows the start never came to an end")
        elif s.verb == "instance stop" and s.state in ("stopping", "stopped"):
            if not any(g >= s.generation and st in ENDED for g, st in seen):
                out.append(f"{s.line()}: its history shows it stopped at no generation from then on")
    return out


async def _instance_history(js: JetStreamContext, silos: set[str]) -> dict[str, list[tuple[int, str]]]:
    """Each instance's (generation, state) changes, as its `instance.changed` events tell them: v2 and v1
    both (a replica of an earlier release, in a rolling upgrade, sends v1 alone)."""
    out: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for silo in sorted(silos):
        for version, schema in ((1, InstanceChanged), (2, InstanceChangedV2)):
            subject = subjects.event(silo, "instance", "changed", version=version)
            async for msg in stored.messages(js, subjects.EVENTS_STREAM, subject):
                try:
                    _, event = decode(msg.data or b"", schema)
                except BadMessage:
                    continue
                assert isinstance(event, InstanceChanged | InstanceChangedV2)
                out[str(event.instance.id)].append((event.instance.generation, str(event.instance.state)))
    return out
