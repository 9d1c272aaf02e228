"""Following the events (issue 14, item 3): `rackctl events follow`, and the example third-party consumer
(examples/events_consumer), each printing the events of a start and a stop; a silo's operator follows
its own silo only, and no follower can re-point a service's durable consumer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from nats.js import api

from deploy import identities
from deploy.stack import Stack
from rackctl.client import Client
from shared import bus
from shared.topology import subjects
from tests.conftest import GiB, connect_as, unique, wait_state
from tests.test_cli import ROOT, _env, rackctl

EXAMPLE = ROOT / "examples" / "events_consumer" / "consume.py"


async def _lines_until(
    stream: asyncio.StreamReader, done: Callable[[list[str]], bool], timeout: float = 30
) -> list[str]:
    """Lines read until `done(lines)` holds (or the time is up: the test then fails on what it got)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while not done(lines) and (left := deadline - time.monotonic()) > 0:
        try:
            raw = await asyncio.wait_for(stream.readline(), left)
        except TimeoutError:
            break
        if not raw:
            break
        lines.append(raw.decode().rstrip("\n"))
    return lines


async def _start_and_stop(client: Client, silo: str) -> None:
    await client.instance_create(silo, "web", "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, "web", "vm")
    await wait_state(client, silo, "web", "vm", "running")
    await client.instance("stop", silo, "web", "vm")
    await wait_state(client, silo, "web", "vm", "stopped")


async def _spawn(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT
    )


async def _stop(proc: asyncio.subprocess.Process) -> str:
    if proc.returncode is None:
        proc.terminate()
    _, err = await asyncio.wait_for(proc.communicate(), 10)
    return err.decode()


def _saw_running_and_stopped(instance: str, lines: list[str]) -> bool:
    mine = [line for line in lines if instance in line]
    return any("running" in line for line in mine) and any("stopped" in line for line in mine)


async def test_events_follow_prints_a_start_and_a_stop(stack: Stack, client: Client) -> None:
    silo = unique("silo")
    await client.silo_create(silo)
    await client.project_create(silo, "web")
    proc = await _spawn(
        sys.executable, "-m", "rackctl.main", "events", "follow", "--silo", silo, env=_env(stack.nats_url)
    )
    try:
        assert proc.stdout is not None
        header = await _lines_until(proc.stdout, lambda lines: bool(lines), timeout=15)
        assert header and header[0].split() == ["TIME", "SILO", "EVENT", "NAME", "STATE", "GENERATION"]
        await _start_and_stop(client, silo)
        lines = await _lines_until(proc.stdout, lambda ls: _saw_running_and_stopped("web/vm", ls))
    finally:
        err = await _stop(proc)
    assert _saw_running_and_stopped("web/vm", lines), (lines, err)
    for line in lines:
        assert line.split()[1] == silo  # its own silo's events only
    [running] = [line for line in lines if " running " in f" {line} "]
    assert running.split()[2:4] == ["instance.changed", "web/vm"]


async def test_events_follow_since_and_json(stack: Stack, client: Client) -> None:
    """With --since it starts in the past; --json prints one envelope per line; --count stops it."""
    silo = unique("silo")
    await client.silo_create(silo)
    await client.project_create(silo, "web")
    r = await rackctl(stack, "events", "follow", "--silo", silo, "--since", "10m", "--count", "2", "--json")
    assert r.code == 0, r
    first, second = (json.loads(line) for line in r.out.splitlines())
    assert first["subject"] == subjects.event(silo, "silo", "created")
    assert first["event"]["schema"] == "rp.evt.silo.created" and first["event"]["data"]["name"] == silo
    assert second["subject"] == subjects.event(silo, "project", "created")
    assert second["seq"] > first["seq"]


def _with_silo_operator(stack: Stack, silo: str) -> Path:
    assert stack.security is not None and stack.nats is not None
    name = f"silo-operator-{silo}"
    if name not in stack.security.store.identities:
        stack.security.add(identities.silo_operator(silo))
    stack.security.server_conf()
    stack.nats.reload()
    return stack.security.write_context(f"op-{silo}", name, stack.nats_url or "")


async def test_a_silo_operator_follows_its_own_silo_only(stack: Stack, client: Client) -> None:
    mine, theirs = unique("silo"), unique("silo")
    for silo in (mine, theirs):
        await client.silo_create(silo)
    context = _with_silo_operator(stack, mine)
    r = await rackctl(
        stack, "events", "follow", "--silo", mine, "--since", "10m", "--count", "1", "--context", str(context)
    )
    assert r.code == 0 and mine in r.out, r
    for other in ((), ("--silo", theirs)):  # every silo's events, or another's: refused by the broker
        r = await rackctl(stack, "events", "follow", *other, "--count", "1", "--context", str(context))
        assert r.code == 1, r
        assert "forbidden" in r.err and "may not send on $JS.API.CONSUMER.CREATE.EVENTS" in r.err, r


@pytest.mark.parametrize("durable", identities.durables_of(subjects.EVENTS_STREAM))
async def test_no_follower_can_re_point_or_drain_a_durable(stack: Stack, durable: str) -> None:
    """A create request naming an existing consumer would update it, filter included: a follower's grant
    names any consumer but these, so a silo's operator cannot turn a service's durable to its own silo, nor
    pull from it."""
    silo = unique("silo")
    _with_silo_operator(stack, silo)
    before = await _filter_of(stack, durable)
    nc = await connect_as(stack, f"silo-operator-{silo}")
    js = nc.jetstream()
    try:
        config = api.ConsumerConfig(
            name=durable,
            durable_name=durable,
            filter_subject=subjects.event_pattern(silo),
            ack_policy=api.AckPolicy.EXPLICIT,
        )
        create = f"$JS.API.CONSUMER.CREATE.EVENTS.{durable}.{subjects.event_pattern(silo)}"
        with pytest.raises(bus.CommandError) as refused:
            await bus.unless_denied(nc, create, js.add_consumer("EVENTS", config, timeout=5))
        assert refused.value.code == "forbidden"
        pull = f"$JS.API.CONSUMER.MSG.NEXT.EVENTS.{durable}"
        with pytest.raises((bus.CommandError, nats.errors.TimeoutError)):
            await bus.unless_denied(nc, pull, nc.request(pull, b'{"batch": 1, "no_wait": true}', timeout=3))
    finally:
        await nc.close()
    assert await _filter_of(stack, durable) == before


async def _filter_of(stack: Stack, durable: str) -> str | None:
    """The durable's filter on EVENTS, or None while it does not exist (the events reader's, before its
    first run)."""
    auditor = await connect_as(stack, "auditor")
    try:
        return (await auditor.jetstream().consumer_info("EVENTS", durable)).config.filter_subject
    except nats.js.errors.NotFoundError:
        return None
    finally:
        await auditor.close()


async def test_the_example_consumer_prints_a_start_and_a_stop(
    stack: Stack, client: Client, tmp_path: Path
) -> None:
    """examples/events_consumer, as a third party runs it: a subscriber's identity (events-reader), its
    durable on its own stream, and the published schemas; it prints the events of a start and a stop."""
    assert stack.security is not None and stack.nats_url
    context = stack.security.write_context("events-reader", "events-reader", stack.nats_url)
    silo = unique("silo")
    await client.silo_create(silo)
    await client.project_create(silo, "web")
    env = {**_env(stack.nats_url), "PYTHONPATH": ""}  # nothing of rackplane's code on its path
    proc = await _spawn(sys.executable, str(EXAMPLE), "--context", str(context), env=env)
    try:
        assert proc.stderr is not None and proc.stdout is not None
        ready = await _lines_until(proc.stderr, lambda ls: any("following" in x for x in ls), timeout=15)
        assert any("following rp.evt.> as events-reader" in x for x in ready), ready
        await _start_and_stop(client, silo)
        instance = f"{silo}/web/vm"
        lines = await _lines_until(proc.stdout, lambda ls: _saw_running_and_stopped(instance, ls))
    finally:
        err = await _stop(proc)
        reader = await connect_as(stack, identities.EVENTS_READER)  # a subscriber deletes its own consumers
        try:
            await reader.jetstream().delete_consumer(
                subjects.subscriber_stream(identities.EVENTS_READER), identities.EVENTS_READER
            )
        finally:
            await reader.close()
    assert _saw_running_and_stopped(instance, lines), (lines, err)
    assert "refused" not in err, err  # every event valid against its published schema
    assert any(f"rp.evt.{silo}.instance.changed.v2  {instance} running (generation" in x for x in lines)


async def test_the_auditor_cannot_re_point_a_durable(stack: Stack) -> None:
    """The auditor reads streams by message, and creates no consumer: a create request naming a service's
    durable, on any create subject, with or without `durable_name`, leaves the durable as it was."""
    durable = "accounting-silos"
    before = await _filter_of(stack, durable)
    config = {
        "name": durable,
        "filter_subject": "rp.evt.acme.>",
        "ack_policy": "explicit",
        "deliver_policy": "all",
        "max_deliver": -1,
        "max_ack_pending": 10000,
    }
    nc = await connect_as(stack, "auditor")
    try:
        for create in (
            "$JS.API.CONSUMER.CREATE.EVENTS",
            f"$JS.API.CONSUMER.CREATE.EVENTS.{durable}.rp.evt.acme.>",
        ):
            for body in (config, {**config, "durable_name": durable}):
                request = json.dumps({"stream_name": "EVENTS", "config": body}).encode()
                with contextlib.suppress(bus.CommandError, nats.errors.TimeoutError):
                    await bus.unless_denied(nc, create, nc.request(create, request, timeout=3))
    finally:
        await nc.close()
    assert await _filter_of(stack, durable) == before
