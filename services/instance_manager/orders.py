"""Recovery's orders, applied as conditions.

Recovery decides from its own picture of the rack, built from events and inventories, and that picture
lags: an event not yet handled, an inventory redelivered from before a reboot. So an order names what
recovery saw (the instance's generation, the VMM, the boot it was placed on, the boot that proves it
lost), and each function here checks all of it under this service's own row locks, against this
service's own records and clock, before it changes anything. When something no longer holds, it answers
`stale` (counted under `orders.stale.<order>`, and logged) and changes nothing; recovery's next pass, on
a fresher picture, decides again.

Locks are taken VMM record first, then instance, the order a sled's report takes too.
"""

from __future__ import annotations

import logging
import time
import uuid

import asyncpg

from services.instance_manager.app import App
from services.instance_manager.base import SOURCE, Q
from services.instance_manager.lifecycle import Evidence, Lost, fail_vmms
from shared import bus, telemetry
from shared.db import enqueue
from shared.messages import LostVmm, VmmDestroy, VmmLostV2, VmmStuck, VmmZombie
from shared.messages.orders import shows_awaited
from shared.topology import subjects

log = logging.getLogger(__name__)


class Stale(bus.CommandError):
    """What the order was decided on no longer holds."""

    def __init__(self, order: str, message: str) -> None:
        super().__init__("stale", message)
        telemetry.count(f"orders.stale.{order}")
        log.info("order %s refused as stale: %s", order, message)


def _check_claim(
    order: str,
    vmm: asyncpg.Record | None,
    inst: asyncpg.Record | None,
    vmm_id: uuid.UUID,
    instance_id: uuid.UUID,
    generation: int,
) -> None:
    """Raise Stale unless the VMM record is live and its instance is still at `generation` with it active
    or as its migration target."""
    if vmm is None or vmm["ended_at"] is not None:
        raise Stale(order, f"VMM {vmm_id} has {'no record' if vmm is None else 'ended already'}")
    assert inst is not None
    if inst["id"] != instance_id:
        raise Stale(order, f"VMM {vmm_id} belongs to instance {inst['id']}, not {instance_id}")
    if inst["generation"] != generation:
        raise Stale(order, f"instance {instance_id} is at generation {inst['generation']}, not {generation}")
    if vmm_id not in (inst["active_vmm_id"], inst["target_vmm_id"]):
        raise Stale(order, f"instance {instance_id} no longer runs on VMM {vmm_id}")


async def _locked(
    conn: asyncpg.Connection, vmm_ids: list[uuid.UUID]
) -> tuple[dict[uuid.UUID, asyncpg.Record], dict[uuid.UUID, asyncpg.Record]]:
    """The VMM records and their instances, locked in that order (each in id order), by id."""
    vmms = {r["id"]: r for r in await conn.fetch(Q["vmms_lock"], sorted(vmm_ids, key=lambda u: u.int), 0)}
    live = {r["instance_id"] for r in vmms.values() if r["ended_at"] is None}
    insts = {r["id"]: r for r in await conn.fetch(Q["instances_lock"], sorted(live, key=lambda u: u.int))}
    return vmms, insts


async def lost(app: App, conn: asyncpg.Connection, batch: list[VmmLostV2]) -> list[dict[uuid.UUID, str]]:
    """VMMs whose sled has come back on a later boot than the one they were placed on are gone. Several
    orders at once (a rack's reboot brings one a sled): each VMM is checked on its own, and those that pass
    are failed together (lifecycle.fail_vmms), in a fixed number of statements however many there are.
    Returns, for each order, what became of each of its VMMs, or `stale: <why>`."""
    vmms, insts = await _locked(conn, [v.vmm_id for order in batch for v in order.vmms])
    rows = await conn.fetch(Q["sleds_seen"], sorted({o.sled_id for o in batch}), app.settings.unknown_after())
    seen = {r["id"]: r for r in rows}
    results: list[dict[uuid.UUID, str]] = [{} for _ in batch]
    doomed: dict[uuid.UUID, Lost] = {}
    for order, result in zip(batch, results, strict=True):
        reason = f"sled {order.sled_id} rebooted (boot %d ended; boot {order.sled_boot} began)"
        for v in order.vmms:
            vmm = vmms.get(v.vmm_id)
            try:
                _check_claim(
                    "lost",
                    vmm,
                    insts.get(vmm["instance_id"]) if vmm else None,
                    v.vmm_id,
                    v.instance_id,
                    v.generation,
                )
                assert vmm is not None
                _check_lost(order, v, vmm, seen.get(order.sled_id))
            except Stale as e:
                result[v.vmm_id] = f"stale: {e.message}"
                continue
            doomed[v.vmm_id] = Lost(
                v.vmm_id, reason % v.vmm_boot, Evidence("rebooted", vmm["boot_number"], order.sled_boot)
            )
    outcome = await fail_vmms(app, conn, list(doomed.values()))
    for order, result in zip(batch, results, strict=True):
        result.update({v.vmm_id: outcome[v.vmm_id] for v in order.vmms if v.vmm_id not in result})
    return results


def _check_lost(order: VmmLostV2, v: LostVmm, vmm: asyncpg.Record, sled: asyncpg.Record | None) -> None:
    if vmm["sled_id"] != order.sled_id:
        raise Stale("lost", f"VMM {v.vmm_id} is on {vmm['sled_id']}, not {order.sled_id}")
    if vmm["boot_number"] != v.vmm_boot:
        raise Stale("lost", f"VMM {v.vmm_id} was placed on boot {vmm['boot_number']}, not {v.vmm_boot}")
    if sled is None or (sled["boot_number"] or 0) < order.sled_boot:
        held = sled["boot_number"] if sled else None
        raise Stale("lost", f"sled {order.sled_id} is on boot {held} here, not yet {order.sled_boot}")


async def stuck(app: App, conn: asyncpg.Connection, order: VmmStuck) -> str:
    """An instance that has been starting, stopping or migrating past the timeout, on a sled that answers,
    loses that VMM (a migration is called off; the instance runs on where it was); but only on the sled's
    own evidence (`_check_stuck`), never on a report that is merely late. The caller has waited for the
    VMM reports and inventories already received to be applied (App.reports_first)."""
    vmms, insts = await _locked(conn, [order.vmm_id])
    vmm = vmms.get(order.vmm_id)
    inst = insts.get(vmm["instance_id"]) if vmm else None
    _check_claim("stuck", vmm, inst, order.vmm_id, order.instance_id, order.generation)
    assert vmm is not None and inst is not None
    timeout = app.settings.transition_timeout
    if inst["state"] != order.state:
        raise Stale("stuck", f"instance {order.instance_id} is {inst['state']}, not {order.state}")
    wanted = inst["target_vmm_id"] if order.state == "migrating" else inst["active_vmm_id"]
    if wanted != order.vmm_id:
        raise Stale("stuck", f"VMM {order.vmm_id} is not the one instance {order.instance_id} waits on")
    evidence = await conn.fetchrow(
        Q["stuck_evidence"], order.vmm_id, order.instance_id, timeout, app.settings.unknown_after()
    )
    _check_stuck(order, evidence, timeout)
    shown = evidence["shown"]
    seen = f"lists it as {shown}" if shown else "does not list it"
    reason = f"{order.state} for over {timeout:g}s (sled {evidence['sled_id']} {seen})"
    proof = (evidence["boot_number"], evidence["inventory_seq"])  # the inventory judged on, by (boot, seq)
    lost = Lost(order.vmm_id, reason, Evidence("stuck", vmm["boot_number"], *proof))
    return (await fail_vmms(app, conn, [lost]))[order.vmm_id]


def _check_stuck(order: VmmStuck, evidence: asyncpg.Record, timeout: float) -> None:
    """A VMM is judged stuck only on its sled's evidence: the sled answers, was asked (to run it, or to
    stop it) longer than the timeout ago by this service's clock, has taken that order off its stream,
    and its latest inventory, made longer than the timeout after it was asked and after the VMM took the
    state it lists (by the sled's clock), does not show what the instance waits for (running; gone for
    a stop). A start whose saga has not asked the sled yet, or whose order waits unread behind others on
    the sled's stream, is not stuck at all: waiting is not failing. An inventory that shows the awaited
    state means the sled's report is late, not the VMM: for a migration, the target already runs the
    instance (it may be its only copy), and is never destroyed for it."""
    sled, vmm_id = evidence["sled_id"], order.vmm_id
    if not evidence["answering"]:
        raise Stale("stuck", f"sled {sled} does not answer: its instances are unknown, not failed")
    if evidence["asked_at"] is None:
        raise Stale("stuck", f"sled {sled} has not been asked to run VMM {vmm_id} yet: it cannot be stuck")
    if not evidence["read"]:
        read, order_at = evidence["commands_read"], evidence["asked_seq"]
        where = f"it has read its commands up to {read}, the order is {order_at} on the stream"
        raise Stale("stuck", f"sled {sled} has not taken the order to run VMM {vmm_id} yet ({where})")
    if not evidence["overdue"]:
        since = f"for under {timeout:g}s since sled {sled} was asked"
        raise Stale("stuck", f"instance {order.instance_id} has been {order.state} {since}")
    if not evidence["judged"]:
        made = f"made over {timeout:g}s after it was asked"
        raise Stale("stuck", f"no inventory of sled {sled} {made} has been applied yet: no evidence")
    if shows_awaited(order.state, evidence["shown"]):
        shown, made = evidence["shown"], evidence["inventory_made_at"].isoformat()
        seen = f"lists VMM {vmm_id} as {shown}" if shown else f"no longer lists VMM {vmm_id}"
        raise Stale("stuck", f"sled {sled} {seen} (inventory made {made}): its report is late, not the VMM")
    if not evidence["settled"]:
        shown, since = evidence["shown"], evidence["shown_since"].isoformat()
        raise Stale(
            "stuck", f"sled {sled} lists VMM {vmm_id} as {shown} only since {since}: not {timeout:g}s"
        )


async def zombie(app: App, conn: asyncpg.Connection, order: VmmZombie) -> str:
    """A VMM a sled runs that nobody claims: destroyed, if no instance names it as active or target right
    now and its record (if it has one) ended longer than the grace period ago, by this service's clock."""
    grace = app.settings.zombie_grace
    vmm = await conn.fetchrow(Q["vmms_lock"], [order.vmm_id], grace)
    claimants = await conn.fetch(Q["vmm_claimants"], order.vmm_id)
    if claimants:
        raise Stale("zombie", f"VMM {order.vmm_id} is claimed by instance {claimants[0]['id']}")
    if vmm is not None:
        if vmm["sled_id"] != order.sled_id:
            raise Stale("zombie", f"VMM {order.vmm_id} is placed on {vmm['sled_id']}, not {order.sled_id}")
        if vmm["ended_at"] is None:
            raise Stale("zombie", f"VMM {order.vmm_id} has a live record")
        if not vmm["ended_long_ago"]:
            raise Stale("zombie", f"VMM {order.vmm_id} ended less than {grace:g}s ago")
    bucket = int(time.time() // 30)  # a new message id every 30 s, so that a lost destroy is sent again
    await enqueue(
        conn,
        subjects.sled_command(order.sled_id, "vmm.destroy"),
        VmmDestroy(vmm_id=order.vmm_id),
        source=SOURCE,
        key=f"zombie:{order.vmm_id}:{bucket}",
    )
    telemetry.count("zombies.destroyed")
    return "destroyed"
