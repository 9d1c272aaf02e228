"""The Node consumer of rackplane's events (examples/events_consumer_node, nats.js and ajv), run
as a third party runs it, against the session stack: it prints the events of a start and a stop, each
valid against its published schema, and reports and terminates what fails its schema or has none.

Skipped, with the reason, where node or npm is absent or the npm registry cannot be reached for its one
`npm ci` (after which the example's node_modules stays, ignored by git)."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import nats.js.errors
import pytest
from nats.js import JetStreamContext

from deploy.stack import Stack
from rackctl.client import Client
from tests.conftest import connect_as, eventually, unique
from tests.npm import npm_ci
from tests.test_cli import ROOT, _env
from tests.test_events import _lines_until, _spawn, _start_and_stop, _stop

EXAMPLE = ROOT / "examples" / "events_consumer_node"


@pytest.fixture(scope="module")
def node_example() -> Path:
    npm_ci(EXAMPLE, "the Node example (examples/events_consumer_node)")
    return EXAMPLE / "consume.mjs"


def _reader_context(stack: Stack) -> tuple[Path, str, str]:
    """The `events-reader` context (as `make run` writes it), its stream and its durable."""
    assert stack.security is not None and stack.nats_url
    path = stack.security.write_context("events-reader", "events-reader", stack.nats_url)
    context = json.loads(path.read_text())
    return path, context.get("stream") or "EVENTS", context["identity"]


def _ran_then_stopped(instance: str, lines: list[str]) -> bool:
    """A `running` line of the instance, and a `stopped` one after it (not the `stopped` of its creation)."""
    mine = [line.split("  ")[-1] for line in lines if f"  {instance} " in line]
    running = [i for i, x in enumerate(mine) if " running " in x]
    return bool(running) and any(" stopped " in x for x in mine[running[0] :])


@contextlib.asynccontextmanager
async def _as_reader(stack: Stack, identity: str) -> AsyncIterator[JetStreamContext]:
    """JetStream as the subscriber itself, which may read and delete the consumers on its own stream."""
    nc = await connect_as(stack, identity)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


async def _forget(stack: Stack, stream: str, durable: str) -> None:
    """The next run (this file's, or the Python example's) starts from a durable of its own."""
    async with _as_reader(stack, durable) as js:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_consumer(stream, durable)


async def test_the_node_consumer_prints_a_start_and_a_stop(
    stack: Stack, client: Client, node_example: Path
) -> None:
    """Its identity's durable on its context's stream; every event valid under ajv 2020-12 strict; each
    change printed once, in v2 (the v1 copy acknowledged unread)."""
    context, stream, durable = _reader_context(stack)
    silo = unique("silo")
    await client.silo_create(silo)
    await client.project_create(silo, "web")
    proc = await _spawn("node", str(node_example), "--context", str(context), env=_env(stack.nats_url))
    try:
        assert proc.stderr is not None and proc.stdout is not None
        ready = await _lines_until(proc.stderr, lambda ls: any("following" in x for x in ls), timeout=15)
        assert any(
            f"following rp.evt.> on {stream} as events-reader (durable {durable})" in x for x in ready
        ), ready
        await _start_and_stop(client, silo)
        instance = f"{silo}/web/vm"
        lines = await _lines_until(proc.stdout, lambda ls: _ran_then_stopped(instance, ls))
    finally:
        err = await _stop(proc)
        await _forget(stack, stream, durable)
    assert _ran_then_stopped(instance, lines), (lines, err)
    assert "refused" not in err, err  # every event valid against its published schema
    assert any(f"rp.evt.{silo}.instance.changed.v2  {instance} running (generation" in x for x in lines)
    assert not any(f"rp.evt.{silo}.instance.changed  " in x for x in lines), lines  # v1: acked unread


async def test_the_node_consumer_terminates_what_it_cannot_check(
    stack: Stack, client: Client, node_example: Path, tmp_path: Path
) -> None:
    """With no schema file for `rp.evt.silo.created` and one for `rp.evt.project.created` that its events
    fail, both are reported on stderr and terminated: nothing is left for the broker to redeliver."""
    context, stream, durable = _reader_context(stack)
    schemas = tmp_path / "schemas"
    shutil.copytree(ROOT / "docs" / "schemas", schemas)
    (schemas / "rp.evt.silo.created.v1.json").unlink()
    project = schemas / "rp.evt.project.created.v1.json"
    schema = json.loads(project.read_text())
    schema["properties"]["source"]["maxLength"] = 1
    project.write_text(json.dumps(schema))
    silo = unique("silo")
    proc = await _spawn(
        "node",
        str(node_example),
        "--context",
        str(context),
        "--schemas",
        str(schemas),
        env=_env(stack.nats_url),
    )
    try:
        assert proc.stderr is not None
        await _lines_until(proc.stderr, lambda ls: any("following" in x for x in ls), timeout=15)
        await client.silo_create(silo)
        await client.project_create(silo, "web")
        err = await _lines_until(proc.stderr, lambda ls: sum(f"refused rp.evt.{silo}." in x for x in ls) >= 2)
        assert (
            f"refused rp.evt.{silo}.silo.created: no published schema rp.evt.silo.created v1 here"
            in "\n".join(err)
        ), err
        assert any(
            f"refused rp.evt.{silo}.project.created: rp.evt.project.created v1: /source: must NOT have more"
            in x
            for x in err
        ), err

        async with _as_reader(stack, durable) as js:

            async def settled() -> bool:
                info = await js.consumer_info(stream, durable)
                return info.num_ack_pending == 0 and info.num_redelivered == 0

            await eventually(settled, timeout=5)
    finally:
        await _stop(proc)
        await _forget(stack, stream, durable)
