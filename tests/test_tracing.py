"""One trace follows a start from the `rackctl` command through every service, carried as W3C trace
context in NATS headers, in sagas and in outbox rows."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from deploy.stack import Stack
from rackctl.client import Client
from tests.conftest import GiB, eventually

EVERY_SERVICE = {"rackctl", "instance-manager", "accounting", "sled-agent", "recovery"}


def spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_one_trace_spans_a_start_from_the_cli_through_every_service(
    stack: Stack, client: Client, project: tuple[str, str]
) -> None:
    silo, proj = project
    await client.instance_create(silo, proj, "traced", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    traces = stack.env["RACKPLANE_TRACES"]
    path = Path(traces.removeprefix("file:"))

    cli = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rackctl.main",
        "instance",
        "start",
        f"{silo}/{proj}/traced",
        "--wait",
        env={**os.environ, "NATS_URL": stack.nats_url or "", "RACKPLANE_TRACES": traces},
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(cli.communicate(), 60)
    assert cli.returncode == 0, stderr.decode()

    roots = [s for s in spans(path) if s["service"] == "rackctl" and s["parent_id"] is None]
    assert roots, "the CLI exported no root span"
    trace_id = roots[-1]["trace_id"]

    async def every_service_joined() -> set[str]:
        joined = {s["service"] for s in spans(path) if s["trace_id"] == trace_id}
        return (
            joined
            if joined >= {"rackctl", "instance-manager", "accounting", "sled-agent", "recovery"}
            else set()
        )

    joined = await eventually(every_service_joined, timeout=10)
    assert joined >= {"rackctl", "instance-manager", "accounting", "sled-agent", "recovery"}
    in_trace = [s for s in spans(path) if s["trace_id"] == trace_id]
    names = {s["name"] for s in in_trace}
    assert any(n.startswith("saga instance-start charge") for n in names)
    # messaging spans are named by the subject's template, with the kind of their part in the exchange
    kinds = {(s["service"], s["name"]): s["kind"] for s in in_trace}
    assert kinds[("rackctl", "send rp.cmd.{silo}.instance.start")] == "CLIENT"
    assert kinds[("instance-manager", "process rp.cmd.{silo}.instance.start")] == "SERVER"
    assert kinds[("sled-agent", "process rp.sled.{sled}.cmd.vmm.ensure")] == "CONSUMER"
    assert kinds[("accounting", "process rp.acct.part.{partition}.{silo}.{project}.{instance}")] == "CONSUMER"
    assert "PRODUCER" in {k for (service, _), k in kinds.items() if service == "instance-manager"}
    ensure = next(s for s in in_trace if s["name"] == "process rp.sled.{sled}.cmd.vmm.ensure")
    attrs = ensure["attributes"]
    assert attrs["messaging.system"] == "nats"
    assert attrs["messaging.operation.type"] == "process"
    assert attrs["messaging.destination.template"] == "rp.sled.{sled}.cmd.vmm.ensure"
    assert attrs["messaging.destination.name"].startswith("rp.sled.sled-")
    assert attrs["messaging.consumer.group.name"].startswith("sled-agent-sled-")
    assert attrs["messaging.message.id"]
    sent = {s["span_id"]: s for s in in_trace if s["kind"] == "PRODUCER"}
    assert ensure["parent_id"] in sent  # the consumer's span is a child of the message's producer span
    assert (
        sent[ensure["parent_id"]]["attributes"]["messaging.destination.name"]
        == attrs["messaging.destination.name"]
    )
    # every service with a database shows its queries, as CLIENT spans with the database conventions
    queries = [s for s in in_trace if s["attributes"].get("db.system.name") == "postgresql"]
    assert {s["service"] for s in queries} >= {"instance-manager", "accounting"}
    assert all(s["kind"] == "CLIENT" and s["attributes"]["db.query.text"] for s in queries)
    assert all(s["attributes"]["db.namespace"] == "rackplane" for s in queries)
    assert any(s["attributes"].get("db.query.summary") for s in queries)  # a named query names its span
