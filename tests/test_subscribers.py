"""Subscribers: services that follow the events, each with an identity and a stream of its own
(deploy/subscribers.py).

Two fleet subscribers and one silo subscriber follow a walkthrough in two silos: each fleet subscriber
receives every event (neither splits them with the other), the silo subscriber exactly its silo's; the
broker refuses the silo subscriber a wider filter, another silo's, EVENTS itself and another subscriber's
consumer; a removed subscriber cannot connect. Then the same through rackctl."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.js import api

from deploy import subscribers
from deploy.stack import Stack
from rackctl.client import Client
from shared import bus
from shared.topology import subjects
from tests.conftest import GiB, connect_as, eventually, unique, wait_state
from tests.test_cli import rackctl


def _rack(stack: Stack) -> subscribers.Rack:
    assert stack.security is not None and stack.nats is not None and stack.nats_url
    return stack.security.rack(stack.nats_url, stack.nats.reload)


async def _walkthrough(client: Client, silo: str) -> None:
    """The README's walkthrough, in short: a silo, a project, an instance started and stopped."""
    await client.silo_create(silo)
    await client.project_create(silo, "web")
    await client.instance_create(silo, "web", "frontend", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, "web", "frontend")
    await wait_state(client, silo, "web", "frontend", "running")
    await client.instance("stop", silo, "web", "frontend")
    await wait_state(client, silo, "web", "frontend", "stopped")


def _key(msg: Any) -> tuple[str, str]:
    """An event, however it was delivered: its subject and its dedupe key."""
    return (msg.subject, (msg.headers or {}).get("Nats-Msg-Id", ""))


async def _read(nc: Any, stream: str, filter_subject: str, silos: tuple[str, ...]) -> list[tuple[str, str]]:
    """Every event of `silos` on `stream`, through a consumer of one's own from the stream's start, in
    order, read until the stream's end as it was when the read began."""
    js = nc.jetstream(timeout=5)
    last = (await js.stream_info(stream)).state.last_seq
    name = unique("reader")
    config = api.ConsumerConfig(
        name=name,
        filter_subject=filter_subject,
        ack_policy=api.AckPolicy.NONE,
        deliver_policy=api.DeliverPolicy.ALL,
        inactive_threshold=30,
    )
    create = f"$JS.API.CONSUMER.CREATE.{stream}.{name}.{filter_subject}"
    await bus.unless_denied(nc, create, js.add_consumer(stream, config))
    sub = await js.pull_subscribe_bind(name, stream)
    out: list[tuple[str, str]] = []
    seq = 0
    while seq < last:
        try:
            msgs = await sub.fetch(256, timeout=2)
        except TimeoutError:
            break
        for m in msgs:
            seq = m.metadata.sequence.stream
            if m.subject.split(".")[2] in silos:
                out.append(_key(m))
    return out


async def test_each_subscriber_sees_its_scope_whole_and_nothing_else(stack: Stack, client: Client) -> None:
    rack = _rack(stack)
    mine, theirs = unique("silo"), unique("silo")
    fleet_a, fleet_b, local = unique("billing"), unique("dashboard"), unique("automation")
    for name, silo in ((fleet_a, None), (fleet_b, None), (local, mine)):
        await subscribers.add(rack, name, silo)
    for silo in (mine, theirs):
        await _walkthrough(client, silo)

    async def read_as(name: str, stream: str, filter_subject: str) -> list[tuple[str, str]]:
        nc = await connect_as(stack, name)
        try:
            return await _read(nc, stream, filter_subject, (mine, theirs))
        finally:
            await nc.close()

    async def all_seen() -> bool:
        """EVENTS read afresh each time (the last events of the walkthrough, an outcome, a usage change,
        may still be on their way), and each subscriber's stream against it."""
        everything = await read_as("test", subjects.EVENTS_STREAM, "rp.evt.>")
        ours = [e for e in everything if e[0].split(".")[2] == mine]
        fleet = [await read_as(n, subjects.subscriber_stream(n), "rp.evt.>") for n in (fleet_a, fleet_b)]
        silo = await read_as(local, subjects.subscriber_stream(local), f"rp.evt.{mine}.>")
        return (  # each the whole of its scope, in order, once
            {s.split(".")[2] for s, _ in everything} == {mine, theirs}
            and len(everything) > 8
            and fleet == [everything, everything]
            and silo == ours
        )

    await eventually(all_seen, timeout=20)

    nc = await connect_as(stack, local)
    try:
        js = nc.jetstream(timeout=5)
        own = subjects.subscriber_stream(local)
        held = (await js.stream_info(own)).state.messages
        assert held == len(await _read(nc, own, f"rp.evt.{mine}.>", (mine,)))  # nothing but its silo's
        refused = [
            f"$JS.API.CONSUMER.CREATE.{own}.wide.rp.evt.>",
            f"$JS.API.CONSUMER.CREATE.{own}.other.rp.evt.{theirs}.>",
            f"$JS.API.CONSUMER.CREATE.{subjects.EVENTS_STREAM}.mine.rp.evt.{mine}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{subjects.subscriber_stream(fleet_a)}.x",
            f"$JS.API.STREAM.INFO.{subjects.subscriber_stream(fleet_a)}",
        ]
        for subject in refused:
            with pytest.raises(bus.CommandError) as e:
                await bus.unless_denied(nc, subject, nc.request(subject, b"{}", timeout=3))
            assert e.value.code == "forbidden", subject
    finally:
        await nc.close()

    seed = Path(shutil.copy(rack.store.seed_file(fleet_b), stack.dir / f"{fleet_b}.nk.kept"))
    await subscribers.remove(rack, fleet_b)

    async def refused() -> bool:  # once the broker has read its config again
        try:
            nc = await bus.connect(stack.nats_url or "", "removed", retry_for=1, seed_file=str(seed))
        except (nats.errors.Error, OSError, TimeoutError):
            return True
        await nc.close()
        return False

    await eventually(refused, timeout=10)
    for name in (fleet_a, local):
        await subscribers.remove(rack, name)


def _seed(stack: Stack, name: str) -> bytes:
    assert stack.security is not None
    return stack.security.store.seed_file(name).read_bytes()


async def test_rackctl_adds_lists_follows_rotates_and_removes_a_subscriber(
    stack: Stack, client: Client, tmp_path: Path
) -> None:
    """The verbs, as a fleet operator runs them: the context written, `events follow` through it (from a
    sequence, through its durable, resuming after what it acked), a rotated key, the subscriber gone."""
    assert stack.security is not None and stack.nats is not None
    rack = ("--identities", str(stack.security.store.dir), "--pid-file", str(stack.nats.pid_file))
    env = {"RACKCTL_CONTEXTS": str(tmp_path)}
    silo, name = unique("silo"), unique("tenant-bot")
    await client.silo_create(silo)
    r = await rackctl(stack, "subscriber", "add", name, "--silo", silo, *rack, "--json", **env)
    assert r.code == 0, r
    made = json.loads(r.out)
    assert made["stream"] == f"EVENTS-{name}" and made["silo"] == silo
    context = json.loads((tmp_path / f"{name}.json").read_text())
    assert context["stream"] == f"EVENTS-{name}" and context["silo"] == silo and context["identity"] == name

    r = await rackctl(stack, "subscriber", "list", *rack, "--json", **env)
    assert r.code == 0, r
    assert {"name": name, "silo": silo, "stream": f"EVENTS-{name}"}.items() <= next(
        row for row in json.loads(r.out) if row["name"] == name
    ).items()

    await client.project_create(silo, "web")
    follow = ("--context", name, "events", "follow", "--durable", "--count", "1", "--json")
    r = await rackctl(stack, *follow, "--from", "1", **env)
    assert r.code == 0, r
    assert json.loads(r.out)["subject"] == subjects.event(silo, "silo", "created")
    r = await rackctl(stack, *follow, **env)  # the durable resumes after the event it acked
    assert r.code == 0, r
    assert json.loads(r.out)["subject"] == subjects.event(silo, "project", "created")
    r = await rackctl(
        stack, "--context", name, "events", "follow", "--silo", unique("silo"), "--count", "1", **env
    )
    assert r.code == 1 and "forbidden" in r.err, r  # another silo's events: refused by the broker
    r = await rackctl(stack, "--context", name, "sled", "list", **env)
    assert r.code == 1 and "may only read events" in r.err, r

    old = _seed(stack, name)
    r = await rackctl(stack, "subscriber", "rotate", name, *rack, **env)
    assert r.code == 0 and _seed(stack, name) != old, r
    r = await rackctl(stack, "--context", name, "events", "follow", "--count", "1", "--from", "1", **env)
    assert r.code == 0, r  # the context names the seed file, which now holds the new key

    # the silo deleted while its subscriber remains: scoped by the silo's name, it would reach a new silo
    # of that name, and the command says so
    r = await rackctl(stack, "project", "delete", f"{silo}/web", **env)
    assert r.code == 0, r
    r = await rackctl(stack, "silo", "delete", silo, **env)
    assert r.code == 0 and f"its identities remain: {name}" in r.out, r
    r = await rackctl(stack, "subscriber", "remove", name, *rack, **env)
    assert r.code == 2 and "--yes" in r.err, r
    r = await rackctl(stack, "subscriber", "remove", name, *rack, "--yes", **env)
    assert r.code == 0 and not (tmp_path / f"{name}.json").exists(), r
    r = await rackctl(stack, "subscriber", "remove", name, *rack, "--yes", **env)
    assert r.code == 1 and f"no subscriber {name!r}" in r.err, r
    r = await rackctl(stack, "subscriber", "add", "auditor", *rack, **env)
    assert r.code != 0 and "subscriber's name" in r.err, r
    r = await rackctl(stack, "subscriber", "add", "default", *rack, **env)
    assert r.code == 1 and "already exists" in r.err, r  # the operator's own context is not overwritten
