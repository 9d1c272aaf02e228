"""A report counts only for the VMM's own sled (issue 28, finding 2): a sled identity that floods reports
about another sled's VMM, on its own subject, changes nothing, and every such report is dead-lettered
with its reason, also when the VMM's own sled's report is in the same batch."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats.errors
from nats.aio.msg import Msg

from deploy.stack import Stack
from rackctl.client import Client
from services.instance_manager import lifecycle
from services.instance_manager.app import App
from services.instance_manager.main import SCHEMA
from shared import bus, db
from shared.bus import MSG_ID
from shared.messages import VmmReport, VmmState, encode, envelope
from shared.topology import subjects
from tests.conftest import (
    GiB,
    assert_invariants,
    connect_as,
    eventually,
    new_project,
    private_rack,
    sleds_known,
    usage_is,
    wait_state,
)

REASON = "forbidden: {liar} reports on VMM {vmm}, which runs on {sled}: a sled speaks only for its own VMMs"


def forged(liar: str, vmm_id: Any, instance_id: Any, generation: int) -> VmmReport:
    """What a rogue sled says about a VMM it does not run: that it failed."""
    return VmmReport(
        sled_id=liar,
        boot_id=uuid.uuid4(),
        boot_number=1,
        seq=generation,
        vmm_id=uuid.UUID(str(vmm_id)),
        instance_id=uuid.UUID(str(instance_id)),
        state=VmmState.failed,
        generation=generation,
    )


async def dead_letters(client: Client, expected: list[bytes], timeout: float = 60.0) -> dict[bytes, str]:
    """What instance-manager's reports consumer dead-lettered (payload -> reason), read on one subscription
    until every `expected` payload is among them or `timeout` passes: under load the consumer may still
    be refusing the flood's tail, and one subscription read once never misses what arrives later."""
    subject = subjects.dead_letter("instance-manager", "instance-manager-vmm-reports")
    sub = await client.nc.jetstream().subscribe(subject, ordered_consumer=True)
    out: dict[bytes, str] = {}
    missing = set(expected)
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        while missing and asyncio.get_running_loop().time() < deadline:
            try:
                msg = await sub.next_msg(timeout=1)
            except nats.errors.TimeoutError:
                continue
            out[msg.data] = (msg.headers or {}).get("Rp-Dlq-Reason", "")
            missing.discard(msg.data)
    finally:
        await sub.unsubscribe()
    assert not missing, f"{len(missing)} of {len(expected)} forged reports not dead-lettered in {timeout}s"
    return out


async def test_a_rogue_sleds_flood_changes_nothing_and_each_report_is_dead_lettered() -> None:
    """While the instance starts (its VMM recorded, its sled's `running` report on its way) and while it
    runs, another sled floods `failed` reports about its VMM: it ends running on the same VMM, charged,
    and every forged report is parked in the DLQ with its reason."""
    async with private_rack("report-sleds", RACKPLANE_SLEDS="2", RACKPLANE_VMM_START_DELAY="3") as rack:
        stack, client, pool = rack
        silo, proj = await new_project(client)
        await client.instance_create(silo, proj, "victim", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        await client.instance("start", silo, proj, "victim")

        async def recorded() -> Any:
            v = await client.instance("show", silo, proj, "victim")
            return v if v["state"] == "starting" and v["sled_id"] else None

        starting = await eventually(recorded)
        vmm, sled = starting["active_vmm_id"], starting["sled_id"]
        liar = "sled-1" if sled == "sled-0" else "sled-0"
        nc = await connect_as(stack, liar)
        js = nc.jetstream()
        sent: list[bytes] = []

        enough = asyncio.Event()

        async def flood() -> None:  # in bursts: many share a fetched batch, with the real report too
            while not enough.is_set():
                burst = [
                    encode(envelope(forged(liar, vmm, starting["id"], 10**6 + len(sent) + i), liar))
                    for i in range(20)
                ]
                await asyncio.gather(
                    *(
                        js.publish(subjects.sled_report(liar, "vmm"), p, headers={MSG_ID: str(uuid.uuid4())})
                        for p in burst
                    )
                )
                sent.extend(burst)  # counted once the broker has each one, never a burst cut short
                await asyncio.sleep(0.05)

        flooding = asyncio.create_task(flood())
        try:
            running = await wait_state(client, silo, proj, "victim", "running")
            assert len(sent) > 10  # the flood overlapped the start
            await asyncio.sleep(2)  # and goes on while it runs
        finally:
            enough.set()
            await flooding
            await nc.close()

        now = await client.instance("show", silo, proj, "victim")
        assert (now["state"], now["active_vmm_id"], now["sled_id"]) == ("running", vmm, sled), now
        assert now["generation"] == running["generation"], now
        assert (
            await pool.fetchval("SELECT ended_at FROM instance_manager.vmms WHERE id = $1", uuid.UUID(vmm))
            is None
        )
        await usage_is(client, {"vcpus": 1, "ram_bytes": GiB, "disk_bytes": GiB}, silo, proj)

        reason = REASON.format(liar=liar, vmm=vmm, sled=sled)

        parked = await dead_letters(client, sent)
        assert {parked[p] for p in sent} == {reason}
        await assert_invariants(pool)


async def test_a_forged_report_in_the_same_batch_as_the_real_one_is_refused_alone(
    stack: Stack, client: Client, project: tuple[str, str]
) -> None:
    """One batch with the VMM's own sled's report and two forged ones from another sled (older and newer
    than it): both forged ones are refused with the reason, the real one is written, the instance runs on."""
    silo, proj = project
    await eventually(lambda: sleds_known(client, 2))
    await client.instance_create(silo, proj, "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "vm")
    v = await wait_state(client, silo, proj, "vm", "running")
    liar = "sled-1" if v["sled_id"] == "sled-0" else "sled-0"
    url = stack.service_database_urls["instance_manager"]
    pool = await db.create_pool(url, SCHEMA, max_size=2)
    nc = await connect_as(stack, "instance-manager")
    try:
        app = App(pool, nc, nc.jetstream(), url, pool)
        vmm_id = uuid.UUID(v["active_vmm_id"])
        gen = await pool.fetchval("SELECT generation FROM vmms WHERE id = $1", vmm_id)
        real = VmmReport(
            sled_id=v["sled_id"],
            boot_id=uuid.UUID(v["vmm_boot_id"]),
            boot_number=v["vmm_boot_number"],
            seq=10**6,
            vmm_id=vmm_id,
            instance_id=uuid.UUID(v["id"]),
            state=VmmState.running,
            generation=gen + 1,
        )
        batch = [
            bus.Delivery(envelope(b, b.sled_id), b, Msg(nc))
            for b in (forged(liar, vmm_id, v["id"], gen), real, forged(liar, vmm_id, v["id"], gen + 5))
        ]
        await lifecycle.apply_vmm_reports(app, batch)
    finally:
        await nc.close()
        await pool.close()

    reason = REASON.format(liar=liar, vmm=vmm_id, sled=v["sled_id"])
    assert [d.refused.reason if isinstance(d.refused, bus.Reject) else d.refused for d in batch] == [
        reason,
        None,
        reason,
    ]
    now = await client.instance("show", silo, proj, "vm")
    assert (now["state"], now["active_vmm_id"], now["generation"]) == (
        "running",
        str(vmm_id),
        v["generation"],
    )
    await client.instance("stop", silo, proj, "vm")  # its own sled still drives it
    await wait_state(client, silo, proj, "vm", "stopped")
