"""The two reconcilers. Both are level-triggered: each pass compares what should be with what is, from
recovery's own tables, and asks for what would make them agree. Every request is idempotent and fenced
(by VMM id, or by the instance generation the decision was made on), so a pass can be cut short at any
point, repeated, or run by two replicas at once: the next pass converges.

Reconciler 1, "what runs where" (runs_where):
  - a VMM placed on an earlier boot of its sled than the sled's latest is lost (the sled rebooted): its
    instance fails, at once;
  - an instance starting or stopping past the timeout, on a sled that still answers and whose latest
    inventory (made past the timeout) does not show what it waits for (its VMM running, or gone for a
    stop), is lost likewise; a migration so judged on its target's sled is called off (its target is
    lost; the instance runs on its source). An inventory that shows it means a late report: no order;
  - a VMM a sled runs but nobody expects, for longer than a grace period, is destroyed (a zombie).
Reconciler 2, "bring them back" (bring_back):
  - a failed instance whose policy is best_effort and that is meant to run is started again, through the
    ordinary start saga (so anywhere with room, quota checked again), once its next restart is due (the
    cooldown, longer after restarts that found no room); any other failed instance comes to rest as
    stopped.

Recovery acts only through orders to instance-manager, and every order is a condition: it names what this
picture showed (the instance's generation, the VMM, its boot, the boot that proves it lost), and
instance-manager refuses it as `stale` when its own records say otherwise. A picture that lags (an event
not yet handled, an inventory redelivered) can therefore delay a repair, never kill a healthy instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
from nats.aio.client import Client as NATS

from shared import bus, db, metrics, telemetry
from shared.messages import (
    InstanceRestart,
    InstanceSettle,
    LostVmm,
    Model,
    VmmLost,
    VmmLostV2,
    VmmStuck,
    VmmZombie,
)
from shared.messages.orders import LOST_BATCH, shows_awaited
from shared.topology import subjects
from shared.waits import woken

log = logging.getLogger(__name__)
SOURCE = "recovery"
Q = db.queries(Path(__file__).parent / "queries.sql")
RECONCILERS = ("runs_where", "bring_back")
"""Reconciler 1 and 2, by the names their passes are locked, counted and timed under."""
CONCURRENCY = 16
LOOK_AGAIN = 0.5
"""Seconds until reconciler 1 looks again after lost VMMs it could not settle: refused as stale (mostly
instance-manager not having applied the sled's new boot yet, when a whole rack reboots at once) or not
answered. The next interval would leave the API calling them running for that long."""


Pass = Callable[[], Awaitable[dict[str, int]]]


def _one_lost(order: VmmLostV2, v: LostVmm) -> VmmLost:
    return VmmLost(
        instance_id=v.instance_id,
        generation=v.generation,
        vmm_id=v.vmm_id,
        sled_id=order.sled_id,
        vmm_boot=v.vmm_boot,
        sled_boot=order.sled_boot,
    )


@dataclass
class Reconciler:
    """Both reconcilers, each in a loop of its own: a rack's worth of restarts (reconciler 2) takes as long
    as starting them does, and must not hold back the truth about the next sled that reboots (reconciler
    1). Each runs a pass when woken, or every `interval`; one replica at a time each."""

    pool: asyncpg.Pool
    nc: NATS
    dsn: str
    interval: float = 10.0
    """Seconds between passes (RACKPLANE_RECONCILE_INTERVAL)."""
    zombie_grace: float = 10.0
    """How long a VMM nobody expects may run before it is destroyed (RACKPLANE_ZOMBIE_GRACE)."""
    transition_timeout: float = 60.0
    """How long an instance may stay starting or stopping before it is looked at
    (RACKPLANE_TRANSITION_TIMEOUT)."""
    unknown_after: float = 15.0
    """Silence after which a sled does not answer (`Settings.unknown_after`)."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Reconciler 1 looks now (a sled came back on a new boot)."""
    wake_restarts: asyncio.Event = field(default_factory=asyncio.Event)
    """Reconciler 2 looks now (an instance failed)."""
    locks: dict[str, db.PassLock] = field(init=False)
    truth_first: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by a pass of reconciler 1; a pass of reconciler 2 waits for it to end before it begins, so
    that after a power loss the API tells the truth before instance-manager is busy restarting."""

    def __post_init__(self) -> None:
        self.locks = {name: db.PassLock(self.dsn, f"recovery-{name}") for name in RECONCILERS}

    async def run(self) -> None:
        await asyncio.gather(
            self._loop("runs_where", self.wake, self.runs_where),
            self._loop("bring_back", self.wake_restarts, self.bring_back),
        )

    async def _loop(self, name: str, wake: asyncio.Event, step: Pass) -> None:
        while True:
            wake.clear()  # before the pass: news that comes during it brings the next one at once
            try:
                await self.run_pass(name, step)
            except Exception as e:
                log.warning("reconcile pass (%s) failed: %s", name, e)
                telemetry.count(f"reconcile.{name}.pass_errors")
            await woken(wake, self.interval)

    async def run_pass(self, name: str, step: Pass) -> dict[str, int] | None:
        """One pass of a reconciler, if no other replica is running one. Returns what it asked for."""
        async with self.locks[name] as mine:
            if not mine:
                telemetry.count(f"reconcile.{name}.passes_skipped")
                return None
            with metrics.timed("rackplane.reconcile.pass.duration", reconciler=name):
                done = await step()
            telemetry.count(f"reconcile.{name}.passes")
            return done

    async def runs_where(self) -> dict[str, int]:
        async with self.truth_first:
            return {
                "lost": await self.lost_vmms(),
                "stuck": await self.stuck_instances(),
                "zombies": await self.zombies(),
            }

    # --- reconciler 1 ---

    async def lost_vmms(self) -> int:
        """One order per sled and boot (up to LOST_BATCH VMMs each), so that a sled's reboot is repaired in
        one transaction however many VMMs it held."""
        rows = await self.pool.fetch(Q["vmms_on_old_boots"])
        by_sled: dict[tuple[str, int], list[LostVmm]] = {}
        for r in rows:
            by_sled.setdefault((r["sled_id"], r["sled_boot"]), []).append(
                LostVmm(
                    instance_id=r["id"],
                    generation=r["generation"],
                    vmm_id=r["vmm_id"],
                    vmm_boot=r["vmm_boot"],
                )
            )
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(order: VmmLostV2) -> int:
            async with sem:
                return await self._lost(order)

        unsettled = await asyncio.gather(
            *(
                one(VmmLostV2(sled_id=sled, sled_boot=boot, vmms=vmms[i : i + LOST_BATCH]))
                for (sled, boot), vmms in by_sled.items()
                for i in range(0, len(vmms), LOST_BATCH)
            )
        )
        if sum(unsettled):
            asyncio.get_running_loop().call_later(LOOK_AGAIN, self.wake.set)
        return len(rows)

    async def _lost(self, order: VmmLostV2) -> int:
        """Send one lost order; returns how many of its VMMs are still to settle (refused as stale, or the
        order failed)."""
        subject = subjects.command(None, "vmm", "lost")
        try:
            reply = await bus.request(self.nc, subject, order, source=SOURCE, timeout=10)
        except bus.CommandError as e:
            if e.code == "unsupported_version":  # an instance-manager of a release before v2, mid-upgrade
                await self._ask_all((subject, _one_lost(order, v), "vmm_lost") for v in order.vmms)
                return 0
            telemetry.count("reconcile.vmm_lost_errors")
            log.warning("lost VMMs on %s: %s", order.sled_id, e.message)
            return len(order.vmms)
        stale = [r for r in reply["results"].values() if r.startswith("stale")]
        telemetry.count("reconcile.vmm_lost", len(order.vmms) - len(stale))
        telemetry.count("reconcile.vmm_lost_stale", len(stale))
        return len(stale)

    async def stuck_instances(self) -> int:
        """Order a VMM stuck only when this picture has the sled's evidence: an inventory made past the
        timeout after the instance's last change that does not show what the instance waits for. One
        that shows it means a late report, not a stuck VMM: no order (instance-manager would refuse it,
        and a migration's target may be the instance's only copy)."""
        rows = await self.pool.fetch(Q["stuck"], self.transition_timeout, self.unknown_after)
        late = [r for r in rows if r["judged"] and shows_awaited(r["state"], r["shown"])]
        stuck = [r for r in rows if r["judged"] and not shows_awaited(r["state"], r["shown"])]
        telemetry.count("reconcile.stuck_reports_late", len(late))
        subject = subjects.command(None, "vmm", "stuck")
        await self._ask_all(
            (
                subject,
                VmmStuck(
                    instance_id=r["id"], generation=r["generation"], vmm_id=r["vmm_id"], state=r["state"]
                ),
                "stuck",
            )
            for r in stuck
        )
        return len(stuck)

    async def zombies(self) -> int:
        unexpected = await self.pool.fetch(Q["unexpected_now"])
        ids = [r["vmm_id"] for r in unexpected]
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(Q["unexpected_forget"], ids)
            await conn.execute(Q["unexpected_note"], ids, [r["sled_id"] for r in unexpected])
        zombies = await self.pool.fetch(Q["zombies"], self.zombie_grace)
        subject = subjects.command(None, "vmm", "zombie")
        await self._ask_all(
            (subject, VmmZombie(vmm_id=z["vmm_id"], sled_id=z["sled_id"]), "zombie") for z in zombies
        )
        return len(zombies)

    # --- reconciler 2 ---

    async def bring_back(self) -> dict[str, int]:
        async with self.truth_first:
            pass  # after reconciler 1's pass under way, if any
        now = datetime.now(UTC)
        restart, settle, waiting = [], [], 0
        for r in await self.pool.fetch(Q["failed"]):
            if r["auto_restart"] == "best_effort" and r["intended_state"] == "running":
                if (r["next_restart_at"] or now) <= now:
                    restart.append(r)
                else:
                    waiting += 1
            else:
                settle.append(r)
        # settles first: they are never refused busy, and restarts may wait their turn
        await self._ask_all(
            (
                subjects.command(None, "instance", "settle"),
                InstanceSettle(instance_id=r["id"], generation=r["generation"]),
                "settle",
            )
            for r in settle
        )
        restarts = (
            (
                subjects.command(None, "instance", "restart"),
                InstanceRestart(instance_id=r["id"], generation=r["generation"]),
                "restart",
            )
            for r in restart
        )
        deferred = await self._ask_all(restarts, until=time.monotonic() + self.interval)
        if deferred:  # instance-manager is busy, not done: the next pass follows at once, on a fresh picture
            self.wake_restarts.set()
        return {"restart": len(restart), "settle": len(settle), "cooling_down": waiting, "deferred": deferred}

    # --- asking instance-manager ---

    async def _ask(self, subject: str, body: Model, what: str, until: float | None = None) -> bool:
        """One order, answered or refused. One refused `busy: retry after N ms` (a restart past
        instance-manager's backlog) is sent again after that time while `until` (monotonic) allows, so
        that restarts go at the pace it finishes them and wait here, not in its tables; what is left at
        `until` is not sent, and says so (True): the next pass, which then follows at once, looks again."""
        while until is None or time.monotonic() < until:
            try:
                await bus.request(self.nc, subject, body, source=SOURCE, timeout=10)
                telemetry.count(f"reconcile.{what}")
                return False
            except bus.CommandError as e:
                telemetry.count(f"reconcile.{what}_{e.code}")
                wait = bus.retry_after(e)
                if wait is not None and until is not None:
                    if time.monotonic() + wait >= until:
                        return True
                    await asyncio.sleep(wait)
                    continue
                # `stale` means our picture was behind (the user acted, another pass did, an event is yet
                # to come): the next pass, with fresher events, decides again
                log.info("%s %s: %s", what, body, e.message)
                return False
        return True

    async def _ask_all(self, requests: Iterable[tuple[str, Model, str]], until: float | None = None) -> int:
        """Every order, CONCURRENCY at a time; returns how many were left unsent at `until`."""
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(subject: str, body: Model, what: str) -> bool:
            async with sem:
                return await self._ask(subject, body, what, until)

        return sum(await asyncio.gather(*(one(*r) for r in requests)))
