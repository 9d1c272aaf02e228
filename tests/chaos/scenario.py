"""The seeded chaos scenario: random operator commands under random faults, then quiesce and check.

Random operator commands (create, start, stop, migrate, delete, pool picks, pool resizes and deletes,
sled reboots, one expunge) run from a few concurrent workers while faults are injected. All run long,
every service's bus is under one kind of fault after another (delay, duplicate, reorder, drop a first
attempt, hold acks, slow handlers, and on the requests they answer, duplicated, late and dropped
replies), and so are the simulated sleds' reports; the workers add held acks and redeliveries of a
sled's inventories around its reboot, sled partitions, kill -9 of any service (restarted a moment
later), restarts of nats-server (stopped, or killed with SIGKILL), an outage of the broker longer than its
dedupe window, and restarts of PostgreSQL. And what issue 28 found a healthy rack does to itself: a rogue
sled identity flooding reports about other sleds' VMMs, a sled's reports held past the transition
timeout, a sled shrinking its capacity below what is reserved on it, instance-manager's database
connections (the saga locks' among them) killed, and pools resized and deleted in a silo whose quota
refuses their starts. Then every fault is lifted, the system is left to settle, and
the invariant checker must find nothing. The report counts the faults each process injected (its
counters, sampled every second) and the scenario's own. Every choice comes from one seed, so a run's
sequence of operations can be replayed (the timing, on a real machine, cannot be).

On the stack of `make run HA=1` (RACKPLANE_HA=1: three broker nodes, PostgreSQL under Patroni, two
processes of each service) the weather loses one machine at a time instead of restarting the one broker
and the one database: a broker node killed with SIGKILL (half the time the one leading a stream), the
database primary's whole node (Patroni and its PostgreSQL; it rejoins as the standby), one service process
(kill -9, as in the one-machine soak); never two at once. Every command the workers sent is kept with its
reply, and at rest `no_acknowledged_command_lost` holds each ok reply against the rack (rackctl/invariants/).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import nats.errors

from deploy.identities import ACCOUNT
from deploy.nats_cluster import NatsCluster
from deploy.patroni import PatroniCluster
from deploy.stack import Stack
from rackctl.client import Client
from rackctl.invariants import Sent, check_each
from shared import bus
from shared.bus import CommandError, NoReply
from shared.messages import (
    AutoRestart,
    DelayFault,
    DuplicateFault,
    HoldAcksFault,
    Quota,
    ReorderFault,
    RequestFault,
    ServiceFaults,
    SimFaults,
    VmmReport,
    VmmState,
)
from shared.messages.base import MAX_HOLD_SECONDS
from shared.messages.simulator import SimSledCapacity
from shared.topology import subjects
from tests.conftest import connect_as

GiB = 2**30
SILO, PROJECT, POOL = "chaos", "p", "warm"
TIGHT, TIGHT_POOL, HOG = "tight", "cold", "hog"
"""A silo whose vCPU quota (TIGHT_QUOTA) its pool does not fit beside its one instance (HOG): the keeper's
starts are refused, and the pool is resized and deleted meanwhile, at times just as the hog's stop makes
room (issue 28, finding 3: the keeper's leak)."""
TIGHT_QUOTA = 3

# How fast the stack under chaos notices and repairs: short, so that a run settles in seconds.
CHAOS_ENV = {
    "RACKPLANE_SLEDS": "5",
    "RACKPLANE_TRANSITION_TIMEOUT": "4",  # below the longest a service fault holds a message (5 s)
    "RACKPLANE_RESTART_COOLDOWN": "1",
    "RACKPLANE_ZOMBIE_GRACE": "3",
    "RACKPLANE_SLED_UNKNOWN_AFTER": "3",
    "RACKPLANE_INVENTORY_INTERVAL": "1",  # the sleds talk every second: traffic for the faults to act on
    "RACKPLANE_ACK_WAIT": "3",
    "RACKPLANE_DUPLICATE_WINDOW": "5",  # an outage of the broker can outlast it: the fences must hold then
    "RACKPLANE_LOG": "WARNING",
    "RACKPLANE_TRACES": "none",
}

WEIGHTS = {
    "create": 14, "start": 20, "stop": 14, "migrate": 8, "delete": 5, "pick": 5,
    "reboot": 3, "expunge": 1, "partition": 3, "kill": 5, "restart_broker": 1, "kill_broker": 1,
    "long_outage": 1, "restart_database": 1,
    "rogue_sled": 2, "hold_reports": 2, "hold_commands": 2, "shrink": 2, "kill_db_connections": 2,
    "pool_churn": 4,
}  # fmt: skip
SELF_HARM = ("rogue_sled", "hold_reports", "hold_commands", "shrink", "kill_db_connections", "pool_churn")
"""The operations that bring what a healthy rack can do to itself (a rogue sled, late reports, a sled whose
orders wait unread, a sled that shrinks, lost database connections, pool churn): left out where replicas
of an earlier release take part (that release does not survive them; its faults are its own, not
today's)."""
WEATHER = ("instance-manager", "accounting", "recovery", "sled-agent")
"""Services whose buses carry faults all run long, one kind after another (the simulated sleds, too)."""
LONG_OUTAGES = 2
"""At most this many broker outages longer than the dedupe window in one run (each holds the rack still)."""

HA_ENV = {"RACKPLANE_HA": "1", "RACKPLANE_SLED_UNKNOWN_AFTER": "15"}
"""The HA soak's stack: `make run HA=1`'s. A sled counts as silent once no inventory of it was applied for
longer than the broker takes to elect new stream leaders (some 5 to 10 s), as in tests/ha: otherwise each
broker node's loss would take every sled out of placement."""
ONE_MACHINE_OPS = ("kill", "kill_broker", "restart_broker", "long_outage", "restart_database")
"""The one broker's and the one database's restarts and outages, and the kill -9 of a service: on the HA
stack, the losses of one machine at a time (LOSSES) take their place."""
LOSSES = {"kill_broker_node": 3, "kill": 4, "kill_db_primary": 1, "kill_etcd_member": 1}
"""The HA soak's losses, drawn one after another by `machine_weather`: a broker node, a service process,
the database primary's node, a member of the etcd that holds the primary's key."""
LOSS_GAP = (2.0, 8.0)
"""Seconds between the end of one loss (the machine back whole) and the next."""
PRIMARY_KILL_EVERY = 300.0
"""At most one loss of the database primary's node per this many seconds of run: writes stop for up to
the leader TTL (20 s) each time, which is about the database downtime of the one-machine soak's restarts."""
KILLS = (
    "kill -9", "broker_kill -9", "broker_restart", "broker outage past the dedupe window", "database_restart",
    "broker node killed", "broker node killed (stream leader)", "database primary's node killed",
    "etcd member killed",
)  # fmt: skip
"""The faults that take a process or a machine away: the summary counts them on a line of their own."""


def ha_weights(weights: dict[str, int]) -> dict[str, int]:
    """The workers' operations in the HA soak: the one-machine restarts and kills left to
    `machine_weather`."""
    return {op: w for op, w in weights.items() if op not in ONE_MACHINE_OPS}


@dataclass
class Report:
    seed: int
    duration: float
    ha: bool = False
    ops: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    invariants: dict[str, int] = field(default_factory=dict)
    """Each invariant checked at the end, with how many violations of it were found."""
    log: list[str] = field(default_factory=list)

    def summary(self) -> str:
        def counts(c: Counter[str]) -> str:
            return f"{sum(c.values())}  " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))

        total = sum(self.ops.values())
        unavailable, timeout = self.outcomes["error:unavailable"], self.outcomes["error:timeout"]
        share = (unavailable + timeout) / total if total else 0.0
        kills = Counter({k: n for k, n in self.faults.items() if k in KILLS})
        lines = [
            f"chaos seed={self.seed} duration={self.duration:g}s{' HA' if self.ha else ''}",
            f"  operations: {counts(self.ops)}",
            f"  outcomes: {counts(self.outcomes)}",
            f"  failed as unavailable or timed out: {unavailable + timeout} of {total} operations "
            f"({share:.1%}): unavailable {unavailable}, timed out {timeout}",
            f"  kills and restarts: {counts(kills)}",
            f"  faults injected: {counts(self.faults)}",
            f"  invariants checked: {len(self.invariants)}  "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.invariants.items())),
            f"  violations: {len(self.violations)}",
            *(f"    {v}" for v in self.violations),
        ]
        return "\n".join(lines)


@dataclass
class Scenario:
    stack: Stack
    client: Client
    db: asyncpg.Pool
    seed: int
    duration: float
    workers: int = 5
    weights: dict[str, int] = field(default_factory=lambda: dict(WEIGHTS))
    """How often each operation is drawn (WEIGHTS, unless given)."""
    excused: Callable[[str], bool] = lambda line: False
    """Violations not held against the run (a replica of an earlier release beside today's does what that
    release did)."""
    records_commands: bool = True
    """Whether every instance-manager replica records the commands it applies (replies.py), so that a copy
    sent again gets the first copy's answer. A replica of a release from before that decides a copy afresh:
    a delete whose first copy ran there and whose reply was lost is refused `not_found` when sent again,
    so in such a run a refusal may follow a copy that ran, and is kept as a command without a reply."""
    report: Report = field(init=False)
    sent: list[Sent] = field(default_factory=list)
    """Every command on a silo, project or instance the run sent, with its reply (or none)."""
    names: list[str] = field(default_factory=list)
    expunged: set[str] = field(default_factory=set)
    shrunk: set[str] = field(default_factory=set)
    """Sleds left reporting less than they were made with (op_shrink), until picked again."""
    _next: int = 0
    _start: float = 0.0
    _infra: asyncio.Lock = field(default_factory=asyncio.Lock)
    _weather: dict[str, asyncio.Lock] = field(default_factory=dict)
    _seen: dict[tuple[str, str], int] = field(default_factory=dict)
    _sends: int = 0

    def __post_init__(self) -> None:
        self.report = Report(self.seed, self.duration, ha=self.stack.ha)

    async def told(self, verb: str, silo: str, project: str | None, name: str, call: Any) -> Any:
        """Send a command and keep what its reply said (`sent`): an ok reply, or none at all (a timeout, or
        the worker's bound: it may have run), or `unavailable` (the service lost its database under the
        transaction, whose commit may have landed, and every resend met the database still away: it may
        have run too); a refusal did nothing and is not kept (unless `records_commands` is off)."""
        seq = self._sends
        self._sends += 1
        try:
            reply = await call
        except CommandError as e:
            if isinstance(e, NoReply) or e.code in ("timeout", "unavailable") or not self.records_commands:
                self.sent.append(Sent(seq, verb, silo, project, name, acked=False))
            e.add_note(name)  # the log names the command's target (worker)
            raise
        except (TimeoutError, asyncio.CancelledError):
            self.sent.append(Sent(seq, verb, silo, project, name, acked=False))
            raise
        data = reply if isinstance(reply, dict) else {}
        self.sent.append(
            Sent(seq, verb, silo, project, name, True, data.get("state"), data.get("generation"))
        )
        return reply

    def note(self, worker: int, op: str, target: str, outcome: str) -> None:
        self.report.log.append(
            f"t={time.monotonic() - self._start:7.2f} w{worker} {op} {target} -> {outcome}"
        )

    async def setup(self) -> None:
        await self.told("silo create", SILO, None, SILO, self.client.silo_create(SILO))
        await self.told("project create", SILO, None, PROJECT, self.client.project_create(SILO, PROJECT))
        await self.client.pool_create(SILO, PROJECT, POOL, size=3, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        await self.client.silo_create(TIGHT, Quota(vcpus=TIGHT_QUOTA))
        await self.client.project_create(TIGHT, PROJECT)
        await self.client.instance_create(TIGHT, PROJECT, HOG, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        await self.client.instance("start", TIGHT, PROJECT, HOG)
        await self._until(TIGHT, HOG, "running", 20)
        await self._tight_pool(TIGHT_QUOTA + 1)

    async def run(self, setup: bool = True) -> Report:
        """The soak (after `setup`, unless the caller ran it already) and the checks at rest."""
        if setup:
            await self.setup()
        self._start = time.monotonic()
        self._weather = {s: asyncio.Lock() for s in WEATHER}
        background = [
            asyncio.create_task(self.service_weather(s, random.Random(f"{self.seed}/{s}"))) for s in WEATHER
        ]
        background.append(asyncio.create_task(self.sled_weather(random.Random(f"{self.seed}/sleds"))))
        background.append(asyncio.create_task(self.sample_faults()))
        losses = random.Random(f"{self.seed}/ha")
        machines = asyncio.create_task(self.machine_weather(losses)) if self.stack.ha else None
        try:
            await asyncio.gather(*(self.worker(w) for w in range(self.workers)))
            if machines is not None:
                await machines  # the loss under way ends with its machine back whole
        finally:
            if machines is not None:
                background.append(machines)
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        await self.quiesce()
        await self._sample()
        return self.report

    async def worker(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        ops, weights = zip(*self.weights.items(), strict=True)
        while time.monotonic() - self._start < self.duration:
            op = rng.choices(ops, weights)[0]
            self.report.ops[op] += 1
            try:
                target = await asyncio.wait_for(getattr(self, f"op_{op}")(rng), 30)
                outcome = "ok"
            except CommandError as e:
                target, outcome = (getattr(e, "__notes__", None) or [""])[-1], f"error:{e.code}"
            except TimeoutError:
                target, outcome = "", "error:timeout"
            self.report.outcomes[outcome] += 1
            self.note(w, op, target or "", outcome)
            await asyncio.sleep(rng.uniform(0, 0.2))

    # --- operator commands ---

    def _pick_name(self, rng: random.Random) -> str:
        return rng.choice(self.names) if self.names else "none"

    async def op_create(self, rng: random.Random) -> str:
        self._next += 1
        name = f"c-{self._next}"
        self.names.append(name)
        policy = rng.choice(list(AutoRestart))
        create = self.client.instance_create(
            SILO, PROJECT, name, vcpus=rng.randint(1, 2), ram_bytes=GiB, disk_bytes=GiB, auto_restart=policy
        )
        await self.told("instance create", SILO, PROJECT, name, create)
        return name

    async def op_start(self, rng: random.Random) -> str:
        name = self._pick_name(rng)
        await self.told(
            "instance start", SILO, PROJECT, name, self.client.instance("start", SILO, PROJECT, name)
        )
        return name

    async def op_stop(self, rng: random.Random) -> str:
        name = self._pick_name(rng)
        await self.told(
            "instance stop", SILO, PROJECT, name, self.client.instance("stop", SILO, PROJECT, name)
        )
        return name

    async def op_migrate(self, rng: random.Random) -> str:
        name = self._pick_name(rng)
        await self.client.instance_migrate(SILO, PROJECT, name)
        return name

    async def op_delete(self, rng: random.Random) -> str:
        name = self._pick_name(rng)
        delete = self.client.instance("delete", SILO, PROJECT, name)
        await self.told("instance delete", SILO, PROJECT, name, delete)
        return name

    async def op_pick(self, rng: random.Random) -> str:
        self._next += 1
        name = f"p-{self._next}"
        self.names.append(name)
        pick = self.client.instance_from_pool(SILO, PROJECT, name, POOL)
        reply = await self.told("instance create", SILO, PROJECT, name, pick)
        return f"{name} ({reply['source']})"

    # --- sleds ---

    def _sled(self, rng: random.Random) -> str:
        live = [
            f"sled-{i}" for i in range(int(CHAOS_ENV["RACKPLANE_SLEDS"])) if f"sled-{i}" not in self.expunged
        ]
        return rng.choice(live)

    async def op_reboot(self, rng: random.Random) -> str:
        """Reboot a sled; half the time with the acks of its inventories held in instance-manager and
        recovery from a moment before to a moment after, so that inventories of the old boot are
        redelivered after the new boot's (they must change nothing)."""
        sled = self._sled(rng)
        if rng.random() < 0.5:
            return await self._reboot_with_redeliveries(rng, sled)
        await self.client.sim_sled("reboot", sled)
        self.report.faults["sled_reboot"] += 1
        return sled

    async def _reboot_with_redeliveries(self, rng: random.Random, sled: str) -> str:
        held = ServiceFaults(
            hold_acks=HoldAcksFault(probability=0.6),
            only=[f"rp.sled.{sled}.report.inventory"],
            seed=rng.randint(0, 2**31),
        )
        async with self._weather["instance-manager"], self._weather["recovery"]:
            for s in ("instance-manager", "recovery"):
                await self.client.faults(s, held.model_copy(update={"clear": True}))
            await asyncio.sleep(rng.uniform(1, 3))
            await self.client.sim_sled("reboot", sled)
            self.report.faults["sled_reboot"] += 1
            await asyncio.sleep(rng.uniform(2, 5))
            for s in ("instance-manager", "recovery"):
                await self.client.faults(s, ServiceFaults(clear=True))
        return f"{sled}, its inventories redelivered"

    async def op_expunge(self, rng: random.Random) -> str:
        if self.expunged:
            return "(one expunge a run)"
        sled = self._sled(rng)
        await self.client.sled_expunge(sled)  # refused (the database is down, say): a later try expunges
        self.expunged.add(sled)
        self.report.faults["sled_expunge"] += 1
        return sled

    async def op_partition(self, rng: random.Random) -> str:
        sled = self._sled(rng)
        await self.client.sim_sled("partition", sled)
        self.report.faults["sled_partition"] += 1
        await asyncio.sleep(rng.uniform(1, 4))
        await self.client.sim_sled("heal", sled)
        return sled

    async def op_rogue_sled(self, rng: random.Random) -> str:
        """A rogue sled identity (one sled's credential, as a compromised or buggy agent holds it) floods,
        for a few seconds, reports on its own subject about other sleds' live VMMs, mostly those in a
        transition (whose real report is on its way, so that forged and real share a fetched batch):
        failed or stopped, with generations far ahead. They must change nothing, and be dead-lettered
        (issue 28, finding 2)."""
        rogue = self._sled(rng)
        try:
            nc = await connect_as(self.stack, rogue)
        except (OSError, ConnectionError, nats.errors.Error) as e:
            return f"{rogue} (broker away: {type(e).__name__})"
        sent, seen = 0, set()
        try:
            js = nc.jetstream()
            until = time.monotonic() + rng.uniform(2, 5)
            while time.monotonic() < until:
                me, victims = await self._victims(rogue)
                if me is None or not victims:
                    await asyncio.sleep(0.2)
                    continue
                weights = [20 if v["state"] in ("starting", "stopping", "migrating") else 1 for v in victims]
                for _ in range(25):
                    v = rng.choices(victims, weights)[0]
                    seen.add(v["id"])
                    forged = VmmReport(
                        sled_id=rogue,
                        boot_id=me["boot_id"],
                        boot_number=max(me["boot_number"] or 1, v["boot_number"] or 1),
                        seq=10**9 + rng.randint(0, 10**9),
                        vmm_id=v["id"],
                        instance_id=v["instance_id"],
                        state=rng.choice([VmmState.failed, VmmState.stopped]),
                        generation=10**6 + rng.randint(0, 10**6),
                    )
                    await bus.publish(js, subjects.sled_report(rogue, "vmm"), forged, source="sled-agent")
                    sent += 1
                    await asyncio.sleep(0.005)
        except (OSError, ConnectionError, nats.errors.Error, asyncpg.PostgresError) as e:
            return f"{rogue}, {sent} forged reports, then the broker went away ({type(e).__name__})"
        finally:
            with contextlib.suppress(Exception):  # the broker may have been killed meanwhile
                await nc.close()
            self.report.faults["rogue sled floods"] += 1
            self.report.faults["rogue sled reports"] += sent
        return f"{rogue}, {sent} forged reports about {len(seen)} VMMs of other sleds"

    async def _victims(self, rogue: str) -> tuple[Any, list[Any]]:
        """The rogue sled's boot as instance-manager holds it, and the other sleds' live VMMs."""
        async with self.db.acquire() as conn:
            me = await conn.fetchrow(
                "SELECT boot_id, boot_number FROM instance_manager.sleds "
                "WHERE id = $1 AND boot_id IS NOT NULL",
                rogue,
            )
            victims = await conn.fetch(
                "SELECT id, instance_id, boot_number, state FROM instance_manager.vmms "
                "WHERE ended_at IS NULL AND sled_id <> $1",
                rogue,
            )
        return me, victims

    async def op_hold_reports(self, rng: random.Random) -> str:
        """A sled's VMM reports held past the transition timeout while its inventories (which already show
        the VMM's state) flow: half the time by the sled itself (a backlog of up to 12 s), else in
        sled-agent's bus (a service fault, at most 5 s). A start must not be judged stuck for a report
        that is only late (issue 28, finding 1)."""
        sled = self._sled(rng)
        timeout = float(CHAOS_ENV["RACKPLANE_TRANSITION_TIMEOUT"])
        if rng.random() < 0.5:
            held = SimFaults(
                sled_id=sled,
                delay_state=rng.choice([None, VmmState.running]),
                delay_seconds=timeout + rng.uniform(1, 8),
                delay_count=rng.randint(1, 5),
            )
            await self.client.sim_faults(held)
            self.report.faults["reports held past the transition timeout (sled)"] += 1
            await asyncio.sleep(rng.uniform(3, 8))
            await self.client.sim_faults(SimFaults(sled_id=sled))
            return f"{sled}, by the sled for {held.delay_seconds:.1f}s"
        late = ServiceFaults(
            delay=DelayFault(min_seconds=timeout + 0.5, max_seconds=max(timeout + 0.5, MAX_HOLD_SECONDS)),
            only=[subjects.sled_report(sled, "vmm")],
            seed=rng.randint(0, 2**31),
        )
        async with self._weather["sled-agent"]:
            await self.client.faults("sled-agent", late.model_copy(update={"clear": True}))
            self.report.faults["reports held past the transition timeout (bus)"] += 1
            try:
                await asyncio.sleep(rng.uniform(3, 8))
            finally:
                await self.client.faults("sled-agent", ServiceFaults(clear=True))
        return f"{sled}, in sled-agent's bus"

    async def op_hold_commands(self, rng: random.Random) -> str:
        """A sled's command consumer lags: every order to it waits on its stream past the transition
        timeout (by up to 8 s more) while its inventories, which do not list the VMMs it was asked for,
        flow. A start whose order waits unread is not stuck (issue 33: waiting is not failing)."""
        sled = self._sled(rng)
        timeout = float(CHAOS_ENV["RACKPLANE_TRANSITION_TIMEOUT"])
        held = SimFaults(sled_id=sled, hold_commands_seconds=timeout + rng.uniform(1, 8))
        await self.client.sim_faults(held)
        self.report.faults["orders held unread past the transition timeout (sled)"] += 1
        await asyncio.sleep(rng.uniform(3, 8))
        await self.client.sim_faults(SimFaults(sled_id=sled))
        return f"{sled}, for {held.hold_commands_seconds:.1f}s"

    async def op_shrink(self, rng: random.Random) -> str:
        """A sled reports less capacity than is reserved on it (it lost cores or DIMMs): for a few seconds,
        or for good (until a later shrink picks it again and gives it back what it was made with; at the
        end of the run it may still be shrunk: a rack has such sleds). Now and then it reboots meanwhile.
        Its boots and sequence must still be recorded, its instances failed when it reboots (issue 28,
        finding 4)."""
        sled = self._sled(rng)
        capacity = subjects.sim_control("sled.capacity")
        if sled in self.shrunk:
            await self.client.call(capacity, SimSledCapacity(sled_id=sled))
            self.shrunk.discard(sled)
            return f"{sled} back to what it was made with"
        seen = next((s for s in await self.client.sled_list() if s["id"] == sled), None)
        reserved = seen["reserved_vcpus"] if seen else 0
        reserved_ram = seen["reserved_ram_bytes"] if seen else 0
        smaller = SimSledCapacity(  # below what is reserved on it, where anything is
            sled_id=sled,
            vcpus=rng.randint(max(1, reserved // 2), max(1, reserved - 1)),
            ram_bytes=rng.choice([None, max(GiB, reserved_ram - GiB)]),
        )
        await self.client.call(capacity, smaller)
        self.report.faults["sled capacity shrunk"] += 1
        if rng.random() < 0.4:
            await asyncio.sleep(rng.uniform(0.5, 2))
            await self.client.sim_sled("reboot", sled)
            self.report.faults["sled rebooted while shrunk"] += 1
        if rng.random() < 0.5:
            self.shrunk.add(sled)
            return f"{sled} to {smaller.vcpus} vCPUs ({reserved} reserved), for good"
        await asyncio.sleep(rng.uniform(2, 6))
        await self.client.call(capacity, SimSledCapacity(sled_id=sled))
        return f"{sled} to {smaller.vcpus} vCPUs ({reserved} reserved) for a while"

    async def op_kill_db_connections(self, rng: random.Random) -> str:
        """pg_terminate_backend on instance-manager's database connections: half the time those holding
        advisory locks (its pass locks, and its saga locks where sagas are locked so), else every one of its
        role. A saga whose lock's connection died must not run in two processes at once (issue 28, finding
        5)."""
        assert self.stack.admin_database_url is not None
        which = rng.choice(["advisory-lock holders", "all"])
        locks = "AND pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory')" if which != "all" else ""
        try:
            admin = await asyncpg.connect(self.stack.admin_database_url, timeout=5)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
            return f"(database away: {type(e).__name__})"
        try:
            killed = await admin.fetchval(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                f"WHERE usename = 'instance_manager' {locks}) t"
            )
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
            return f"(database away: {type(e).__name__})"
        finally:
            with contextlib.suppress(Exception):
                await admin.close()
        self.report.faults[f"instance-manager connections killed ({which})"] += killed or 0
        return f"{killed} connection(s) of instance-manager ({which})"

    async def op_pool_churn(self, rng: random.Random) -> str:
        """Pools resized and deleted while their starts are refused: mostly the tight silo's pool (which its
        quota does not fit), squeezed (the hog stopped, and the pool shrunk or deleted as its room
        appears, when the keeper starts a refused member and retires it in one pass), deleted and made
        again, or resized; now and then the warm pool."""
        what = rng.choices(["squeeze", "resize tight", "delete tight", "resize warm"], [4, 2, 2, 1])[0]
        if what == "resize warm":
            size = rng.randint(1, 4)
            await self.client.pool("resize", SILO, PROJECT, POOL, size=size)
        elif what == "resize tight":
            size = rng.randint(0, TIGHT_QUOTA + 2)
            await self._resize_tight(size)
        elif what == "delete tight":
            await self._delete_tight()
            self.report.faults["pool deleted while starts are refused"] += 1
            await asyncio.sleep(rng.uniform(0, 1))
            size = rng.randint(TIGHT_QUOTA, TIGHT_QUOTA + 2)
            await self._tight_pool(size)
            return f"{TIGHT_POOL} deleted, made again with {size}"
        else:
            return await self._squeeze(rng)
        self.report.faults[f"pool resized ({what.split()[1]})"] += 1
        return f"{what} to {size}"

    async def _squeeze(self, rng: random.Random) -> str:
        """Stop the hog, and as its vCPU comes free shrink or delete the tight pool, before the keeper's
        own pass (each second) starts the member the quota refused: the kicked pass starts it and retires
        it at once. Then the hog starts again, and the pool is made again if it was deleted. A hog left
        stopped (its room taken by the pool meanwhile) gets it back first: the pool deleted, the hog
        started, the pool made again."""
        if (await self.client.instance("show", TIGHT, PROJECT, HOG))["state"] != "running":
            await self._delete_tight()
            await asyncio.sleep(rng.uniform(2, 3))  # the members stopped, their room free
            await self._start_hog()
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            await self._tight_pool(TIGHT_QUOTA + rng.randint(0, 2))
            return f"{TIGHT_POOL} made again around the hog"
        await self.client.instance("stop", TIGHT, PROJECT, HOG)
        if not await self._until(TIGHT, HOG, "stopped", 10):
            return "(the hog did not stop)"
        await asyncio.sleep(rng.uniform(0.1, 0.4))  # its release on its way to accounting
        shrink = rng.random() < 0.5
        if shrink:
            size = (await self.client.pool("show", TIGHT, PROJECT, TIGHT_POOL))["target_size"]
            await self._resize_tight(max(0, size - rng.randint(1, 2)))
            self.report.faults["pool shrunk as its room appeared"] += 1
        else:
            await self._delete_tight()
            self.report.faults["pool deleted as its room appeared"] += 1
        await asyncio.sleep(rng.uniform(1, 3))
        started = await self._start_hog()
        if not shrink:
            await asyncio.sleep(rng.uniform(0.5, 1.5))  # the hog takes its room first
            await self._tight_pool(TIGHT_QUOTA + rng.randint(0, 2))
        return f"{TIGHT_POOL} {'shrunk' if shrink else 'deleted'} as the hog's room appeared; {started}"

    async def _start_hog(self) -> str:
        try:
            await self.client.instance("start", TIGHT, PROJECT, HOG)
        except CommandError as e:  # its room taken by the pool meanwhile: the next squeeze gives it back
            return f"the hog not started ({e.code})"
        return "the hog started"

    async def _until(self, silo: str, name: str, state: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (await self.client.instance("show", silo, PROJECT, name))["state"] == state:
                return True
            await asyncio.sleep(0.05)
        return False

    async def _tight_pool(self, size: int) -> None:
        try:
            await self.client.pool_create(
                TIGHT, PROJECT, TIGHT_POOL, size=size, vcpus=1, ram_bytes=GiB, disk_bytes=GiB
            )
        except CommandError as e:
            if e.code != "conflict":  # there already (made by a try whose reply was lost)
                raise

    async def _resize_tight(self, size: int) -> None:
        try:
            await self.client.pool("resize", TIGHT, PROJECT, TIGHT_POOL, size=size)
        except CommandError as e:
            if e.code != "not_found":
                raise
            await self._tight_pool(size)  # deleted by an operation that could not make it again

    async def _delete_tight(self) -> None:
        try:
            await self.client.pool("delete", TIGHT, PROJECT, TIGHT_POOL)
        except CommandError as e:
            if e.code != "not_found":
                raise

    # --- services and infrastructure ---

    async def service_weather(self, service: str, rng: random.Random) -> None:
        """One service's bus under faults the whole run: a kind for 1 to 4 s, then the next."""
        while True:
            async with self._weather[service]:
                with contextlib.suppress(CommandError, TimeoutError, ConnectionError):
                    body = service_fault(rng, service)
                    await self.client.faults(service, body.model_copy(update={"seed": rng.randint(0, 2**31)}))
                await asyncio.sleep(rng.uniform(1, 4))
                with contextlib.suppress(CommandError, TimeoutError, ConnectionError):
                    await self.client.faults(service, ServiceFaults(clear=True))
            await asyncio.sleep(rng.uniform(0, 0.3))

    async def sled_weather(self, rng: random.Random) -> None:
        """The simulated sleds' reports under faults the whole run, one sled at a time."""
        while True:
            sled = self._sled(rng)
            faults = {
                "delay": SimFaults(sled_id=sled, delay_state=rng.choice([None, VmmState.stopped]),
                                   delay_seconds=rng.uniform(0.5, 3), delay_count=rng.randint(1, 5)),
                "duplicate": SimFaults(sled_id=sled, duplicate=3),
                "drop": SimFaults(sled_id=sled, drop_probability=0.3),
            }[rng.choice(["delay", "duplicate", "drop"])]  # fmt: skip
            with contextlib.suppress(CommandError, TimeoutError, ConnectionError):
                await self.client.sim_faults(faults)
            await asyncio.sleep(rng.uniform(1, 3))
            with contextlib.suppress(CommandError, TimeoutError, ConnectionError):
                await self.client.sim_faults(SimFaults(sled_id=sled))

    async def sample_faults(self) -> None:
        while True:
            await asyncio.sleep(1)
            await self._sample()

    async def _sample(self) -> None:
        """Add what every process's fault counters grew by since the last look: the report counts faults
        actually injected, by kind and service (a process killed meanwhile starts again from zero)."""
        for service in WEATHER:
            with contextlib.suppress(CommandError, TimeoutError, ConnectionError):
                counters = (await self.client.faults(service))["counters"]
                if service == "sled-agent":
                    counters |= (await self.client.stats("sled-agent"))["counters"]
                for name, n in counters.items():
                    if name.startswith(("faults.", "sled.fault.")) and not name.endswith("_delivered"):
                        last = self._seen.get((service, name), 0)
                        self.report.faults[f"{name} ({service})"] += n - last if n >= last else n
                        self._seen[service, name] = n

    async def op_kill(self, rng: random.Random) -> str:
        """kill -9 of any service process (a replica, one at another release's code, included), started
        again a moment later from the same tree."""
        name = rng.choice(list(self.stack.services))
        if self.stack.ha and self._infra.locked():
            return "(another machine is down)"
        async with self._infra:
            svc = self.stack.services[name]
            svc.kill()
            self.report.faults["kill -9"] += 1
            await asyncio.sleep(rng.uniform(0.2, 2))
            svc.start()
        return name

    async def op_kill_broker(self, rng: random.Random) -> str:
        """nats-server killed with SIGKILL (no shutdown: whatever it had not written is lost to it)."""
        assert self.stack.nats is not None
        async with self._infra:
            await asyncio.to_thread(self.stack.nats.kill)
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            await asyncio.to_thread(self.stack.nats.start)
        self.report.faults["broker_kill -9"] += 1
        return "nats-server"

    async def op_long_outage(self, rng: random.Random) -> str:
        """The broker away for longer than its dedupe window: what the senders resend after it is back is
        no longer recognised by the broker, only by the receivers' own fences."""
        assert self.stack.nats is not None
        if self.report.faults["broker outage past the dedupe window"] >= LONG_OUTAGES:
            return "(enough long outages this run)"
        window = float(CHAOS_ENV["RACKPLANE_DUPLICATE_WINDOW"])
        async with self._infra:
            await asyncio.to_thread(self.stack.nats.kill)
            await asyncio.sleep(window + rng.uniform(1, 3))
            await asyncio.to_thread(self.stack.nats.start)
        self.report.faults["broker outage past the dedupe window"] += 1
        return "nats-server"

    async def op_restart_broker(self, rng: random.Random) -> str:
        assert self.stack.nats is not None
        async with self._infra:
            await asyncio.to_thread(self.stack.nats.stop)
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            await asyncio.to_thread(self.stack.nats.start)
        self.report.faults["broker_restart"] += 1
        return "nats-server"

    async def op_restart_database(self, rng: random.Random) -> str:
        assert self.stack.postgres is not None
        async with self._infra:
            await asyncio.to_thread(self.stack.postgres.stop, "immediate")
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            await asyncio.to_thread(self.stack.postgres.start)
        self.report.faults["database_restart"] += 1
        return "postgres"

    async def machine_weather(self, rng: random.Random) -> None:
        """The HA soak's losses of one machine, one after another for the whole run: each (LOSSES) lasts
        until its machine is back whole, then LOSS_GAP passes before the next."""
        ops, weights = zip(*LOSSES.items(), strict=True)
        while time.monotonic() - self._start < self.duration:
            await asyncio.sleep(rng.uniform(*LOSS_GAP))
            op = rng.choices(ops, weights)[0]
            target = await getattr(self, f"op_{op}")(rng)
            self.report.log.append(f"t={time.monotonic() - self._start:7.2f} machines {op} {target}")

    async def op_kill_broker_node(self, rng: random.Random) -> str:
        """One broker node killed with SIGKILL, half the time the one leading a stream (by the stream's
        cluster leader), and started again 1 to 12 s later: the other two keep every stream (three
        replicas) and elect new leaders for what it led. The next machine is lost only once the cluster
        is whole again."""
        cluster = self.stack.nats
        assert isinstance(cluster, NatsCluster)
        if self._infra.locked():
            return "(another machine is down)"
        async with self._infra:
            stream = rng.choice(sorted(subjects.STREAMS)) if rng.random() < 0.5 else None
            leader = await asyncio.to_thread(cluster.stream_leader, stream, ACCOUNT) if stream else None
            node = leader if leader is not None else rng.randrange(len(cluster.nodes))
            await asyncio.to_thread(cluster.kill, node)
            self.report.faults["broker node killed" + (" (stream leader)" if leader is not None else "")] += 1
            try:
                await asyncio.sleep(rng.uniform(1, 12))
            finally:
                await asyncio.to_thread(cluster.start_node, node)
                await asyncio.to_thread(cluster.wait_meta_leader)
        led = f", leading {stream}" if leader is not None else ""
        return f"{cluster.nodes[node].name}{led}"

    async def op_kill_db_primary(self, rng: random.Random) -> str:
        """The database primary's whole node killed (Patroni and its PostgreSQL, SIGKILL): the synchronous
        standby is promoted once the leader's lock expires (TTL 20 s), with every acknowledged commit.
        The old primary starts again a while after and rejoins as the standby; the next machine is lost
        only once it streams. At most one such loss per PRIMARY_KILL_EVERY seconds of run."""
        pg = self.stack.postgres
        assert isinstance(pg, PatroniCluster)
        if self._infra.locked():
            return "(another machine is down)"
        if self.report.faults["database primary's node killed"] >= max(
            1, self.duration // PRIMARY_KILL_EVERY
        ):
            return "(enough failovers this run)"
        async with self._infra:
            old = await asyncio.to_thread(pg.primary)
            if old is None:
                return "(no primary now)"
            await asyncio.to_thread(pg.kill_node, old)
            self.report.faults["database primary's node killed"] += 1
            self.stack.write_manifest()
            try:
                new = await asyncio.to_thread(pg.wait_primary, pg.ttl + 15, old)
                await asyncio.sleep(rng.uniform(2, 10))
            finally:
                await asyncio.to_thread(pg.start_node, old)
                self.stack.write_manifest()
                await asyncio.to_thread(pg.wait_standby, old, 90)
        return f"{pg.members[old].name}, {pg.members[new].name} promoted"

    async def op_kill_etcd_member(self, rng: random.Random) -> str:
        """One of the three etcd members that keep the database primary's key killed with SIGKILL and
        started again 1 to 12 s later: the other two are a quorum, so the primary keeps its key and no
        failover follows; the next machine is lost only once the member is back."""
        pg = self.stack.postgres
        assert isinstance(pg, PatroniCluster)
        if self._infra.locked():
            return "(another machine is down)"
        async with self._infra:
            i = rng.randrange(len(pg.etcd))
            await asyncio.to_thread(pg.kill_etcd, i)
            self.report.faults["etcd member killed"] += 1
            try:
                await asyncio.sleep(rng.uniform(1, 12))
            finally:
                await asyncio.to_thread(pg.start_etcd)
                self.stack.write_manifest()
        return pg.etcd[i].name

    # --- the end of a run ---

    async def quiesce(self, settle_for: float = 120) -> None:
        """Lift every fault, let the system settle, then check every invariant."""
        for svc in self.stack.services.values():
            if not svc.alive:
                svc.start()
        await asyncio.to_thread(self.whole)
        await asyncio.to_thread(self.stack.wait_ready)
        await self.client.clear_faults()
        for sled in await self.client.sim_sled("list"):
            await self.client.sim_faults(SimFaults(sled_id=sled["sled_id"]))
            await self.client.sim_sled("heal", sled["sled_id"])  # a shrunk sled stays so: not a fault
        deadline = time.monotonic() + settle_for
        while True:
            async with self.db.acquire() as conn:
                found = await check_each(
                    conn, at_rest=True, js=self.client.nc.jetstream(), nc=self.client.nc, sent=self.sent
                )
            found = {name: [x for x in lines if not self.excused(x)] for name, lines in found.items()}
            violations = [line for lines in found.values() for line in lines]
            if not violations or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        self.report.violations = violations
        self.report.invariants = {name: len(lines) for name, lines in found.items()}

    def whole(self) -> None:
        """Every broker and database node up (a loss is undone by the operation that made it; this is
        for one cut short by an error)."""
        if isinstance(self.stack.nats, NatsCluster):
            for i, node in enumerate(self.stack.nats.nodes):
                if not node.alive:
                    self.stack.nats.start_node(i)
            self.stack.nats.wait_meta_leader()
        if isinstance(self.stack.postgres, PatroniCluster):
            self.stack.postgres.start_etcd()
            for i, member in enumerate(self.stack.postgres.members):
                if not member.alive:
                    self.stack.postgres.start_node(i)
            self.stack.postgres.wait_primary()


def service_fault(rng: random.Random, service: str) -> ServiceFaults:
    """One to three kinds of bus fault at once, drawn for `service` (request faults only where commands
    are served)."""
    kinds = ["delay", "duplicate", "reorder", "drop_first_attempt", "hold_acks", "slow_handler"]
    kinds += ["requests"] * (service in ("instance-manager", "accounting"))
    merged: dict[str, object] = {}
    for kind in rng.sample(kinds, rng.randint(1, 3)):
        merged |= one_fault(rng, kind).model_dump(exclude_none=True, exclude_defaults=True)
    return ServiceFaults.model_validate(merged)


def one_fault(rng: random.Random, kind: str) -> ServiceFaults:
    return {
        "slow_handler": lambda: ServiceFaults(slow_handler_seconds=rng.uniform(1, 6)),  # a lagging consumer
        "requests": lambda: ServiceFaults(
            requests=RequestFault(
                duplicate_probability=0.3, delay_reply_seconds=rng.uniform(0, 2), drop_reply_probability=0.1
            )
        ),
        "delay": lambda: ServiceFaults(delay=DelayFault(min_seconds=0.05, max_seconds=rng.uniform(0.1, 1))),
        "duplicate": lambda: ServiceFaults(
            duplicate=DuplicateFault(copies=rng.randint(1, 3), bypass_dedupe=True)
        ),
        "reorder": lambda: ServiceFaults(reorder=ReorderFault(window=rng.randint(2, 8))),
        "drop_first_attempt": lambda: ServiceFaults(drop_first_attempt=True),
        "hold_acks": lambda: ServiceFaults(hold_acks=HoldAcksFault(probability=0.3)),
    }[kind]()
