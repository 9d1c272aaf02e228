"""The checks that hold the failures the control plane made against the sleds' own word: a reboot's
failure against the sled's boot history (asked of the simulator), a stuck VMM's against the sled's
reports in SLED_REPORT. Their SQL is failures.sql."""

from __future__ import annotations

import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from rackctl import stored
from shared.bus import CommandError, request
from shared.db import queries
from shared.messages import BadMessage, SimSledList, VmmReport, VmmState, decode
from shared.topology import subjects

Q = queries(Path(__file__).with_suffix(".sql"))


async def sled_boots(nc: NATS) -> dict[str, list[dict[str, Any]]] | None:
    """Each sled's boot history, as the simulated hardware keeps it; None where no simulator answers, or
    this identity may not ask it (the auditor: simulator control is the simulator operator's), and where
    a real rack keeps it in its sleds' service processors, which this checker does not read."""
    try:
        listed = await request(
            nc, subjects.sim_control("sled.list"), SimSledList(), source="check", timeout=5
        )
    except (CommandError, TimeoutError, ConnectionError, nats.errors.Error):
        return None
    return {s["sled_id"]: s.get("boots", []) for s in listed}


async def no_wrongful_kills(conn: asyncpg.Connection, boots: dict[str, list[dict[str, Any]]]) -> list[str]:
    """No instance was failed or stopped by the system on the evidence of a reboot while the boot its VMM
    ran on had not ended: each such failure is held against its sled's boot history (a later boot must
    have begun before the failure). Sleds no longer simulated are not checked."""
    rows = await conn.fetch(Q["reboot_failures"])
    out = []
    for r in rows:
        history = boots.get(r["sled_id"])
        if history is None:
            continue
        ended = any(
            b["number"] > (r["vmm_boot_number"] or 0) and datetime.fromisoformat(b["started_at"]) <= r["at"]
            for b in history
        )
        if not ended:
            out.append(
                f"instance {r['name']} ({r['instance_id']}) was failed at {r['at'].isoformat()} by the "
                f"system ({r['reason']}) while its VMM {r['vmm_id']} ran on boot {r['vmm_boot_number']} of "
                f"{r['sled_id']}, which had not ended (wrongful kill)"
            )
    return out


async def no_running_vmm_called_stuck(conn: asyncpg.Connection, js: JetStreamContext) -> list[str]:
    """No VMM was failed as stuck (a start or a migration past the timeout) that its sled had said runs: each
    such failure names the sled's inventory it was judged on, by (boot, sequence), and none of the sled's
    reports about that VMM made before that inventory in the same boot (the sled's own order of its
    messages, no clock) may say it was running. A failure without that evidence is a failure on a clock
    alone, which a late report turns into a running VM destroyed. A report of running from an earlier boot
    does not count: a VMM cannot outlive its sled's boot, so one judged on a later boot's inventory was
    gone already, and its failure destroyed nothing. Nor may the sled's first report about the VMM (its
    generation 1, sent as it takes the order to run it) come after that inventory: the order was then
    still waiting unread on the sled's stream, and a VMM that waits is not stuck."""
    rows = await conn.fetch(Q["stuck_start_failures"])
    if not rows:
        return []
    ran: dict[tuple[uuid.UUID, int], int] = {}  # each VMM's earliest report of running in a boot: its seq
    took: dict[tuple[uuid.UUID, int], int] = {}  # the seq of the report a sled sent as it took the order
    wanted = {r["vmm_id"] for r in rows}
    for sled in sorted({r["sled_id"] for r in rows}):
        async for msg in stored.messages(js, subjects.SLED_REPORT_STREAM, subjects.sled_report(sled, "vmm")):
            try:
                _, report = decode(msg.data or b"", VmmReport)
            except BadMessage:
                continue
            assert isinstance(report, VmmReport)
            if report.vmm_id not in wanted or report.sled_id != sled:
                continue
            key = (report.vmm_id, report.boot_number)
            if report.state is VmmState.running:
                ran[key] = min(ran.get(key, report.seq), report.seq)
            if report.generation == 1:
                took[key] = min(took.get(key, report.seq), report.seq)
    out = []
    for r in rows:
        what = f"VMM {r['vmm_id']} of instance {r['instance_id']} was failed at {r['at'].isoformat()}"
        what += f" ({r['reason']})"
        if r["proof_seq"] is None:
            out.append(f"{what} with no inventory of {r['sled_id']} as evidence: on a clock alone")
        elif (seq := ran.get((r["vmm_id"], r["proof_boot_number"]))) is not None and seq < r["proof_seq"]:
            out.append(
                f"{what} on {r['sled_id']}'s inventory (boot {r['proof_boot_number']}, seq "
                f"{r['proof_seq']}), though the sled had reported it running before (boot "
                f"{r['proof_boot_number']}, seq {seq}): a late report, not a stuck VMM"
            )
        elif (seq := took.get((r["vmm_id"], r["proof_boot_number"]))) is not None and seq > r["proof_seq"]:
            out.append(
                f"{what} on {r['sled_id']}'s inventory (boot {r['proof_boot_number']}, seq "
                f"{r['proof_seq']}), made before the sled took the order to run it (seq {seq}): an "
                "order waiting unread, not a stuck VMM"
            )
    return out
