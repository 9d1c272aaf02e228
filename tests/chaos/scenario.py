"""The seeded chaos scenario: random operator commands under random faults, then quiesce and check.

Random operator commands (create, start, stop, migrate, delete, pool picks, sled reboots, one expunge)
run from a few concurrent workers while faults are injected. All run long, every service's bus is under
one kind of fault after another (delay, duplicate, reorder, drop a first attempt, hold acks, slow
handlers, and on the requests they answer, duplicated, late and dropped replies), and so are the
simulated sleds' reports; the workers add held acks and redeliveries of a sled's inventories around its
reboot, sled partitions, kill -9 of any service (restarted a moment
later), restarts of nats-server (stopped, or killed with SIGKILL), an outage of the broker longer than its
dedupe window, and restarts of PostgreSQL. Then every fault is lifted, the system is left to settle, and
the invariant checker must find nothing. The report counts the faults each process injected (its
counters, sampled every second). Every choice comes from one seed, so a run's sequence of operations can
be replayed (the timing, on a real machine, cannot be).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import asyncpg

from deploy.stack import Stack
from rackctl.check import check_each
from rackctl.client import Client
from shared.bus import CommandError
from shared.messages import (
    AutoRestart,
    DelayFault,
    DuplicateFault,
    HoldAcksFault,
    ReorderFault,
    RequestFault,
    ServiceFaults,
    SimFaults,
    VmmState,
)

GiB = 2**30
SILO, PROJECT, POOL = "chaos", "p", "warm"

# How fast the stack under chaos notices and repairs: short, so that a run settles in seconds.
CHAOS_ENV = {
    "RACKPLANE_SLEDS": "5",
    "RACKPLANE_TRANSITION_TIMEOUT": "5",
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
}  # fmt: skip
WEATHER = ("instance-manager", "accounting", "recovery", "sled-agent")
"""Services whose buses carry faults all run long, one kind after another (the simulated sleds, too)."""
LONG_OUTAGES = 2
"""At most this many broker outages longer than the dedupe window in one run (each holds the rack still)."""


@dataclass
class Report:
    seed: int
    duration: float
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

        lines = [
            f"chaos seed={self.seed} duration={self.duration:g}s",
            f"  operations: {counts(self.ops)}",
            f"  outcomes: {counts(self.outcomes)}",
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
    report: Report = field(init=False)
    names: list[str] = field(default_factory=list)
    expunged: set[str] = field(default_factory=set)
    _next: int = 0
    _start: float = 0.0
    _infra: asyncio.Lock = field(default_factory=asyncio.Lock)
    _weather: dict[str, asyncio.Lock] = field(default_factory=dict)
    _seen: dict[tuple[str, str], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.report = Report(self.seed, self.duration)

    def note(self, worker: int, op: str, target: str, outcome: str) -> None:
        self.report.log.append(
            f"t={time.monotonic() - self._start:7.2f} w{worker} {op} {target} -> {outcome}"
        )

    async def setup(self) -> None:
        await self.client.silo_create(SILO)
        await self.client.project_create(SILO, PROJECT)
        await self.client.pool_create(SILO, PROJECT, POOL, size=3, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)

    async def run(self) -> Report:
        await self.setup()
        self._start = time.monotonic()
        self._weather = {s: asyncio.Lock() for s in WEATHER}
        background = [
            asyncio.create_task(self.service_weather(s, random.Random(f"{self.seed}/{s}"))) for s in WEATHER
        ]
        background.append(asyncio.create_task(self.sled_weather(random.Random(f"{self.seed}/sleds"))))
        background.append(asyncio.create_task(self.sample_faults()))
        try:
            await asyncio.gather(*(self.worker(w) for w in range(self.workers)))
        finally:
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        await self.quiesce()
        await self._sample()
        return self.report

    async def worker(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        ops, weights = zip(*WEIGHTS.items(), strict=True)
        while time.monotonic() - self._start < self.duration:
            op = rng.choices(ops, weights)[0]
            self.report.ops[op] += 1
            try:
                target = await asyncio.wait_for(getattr(self, f"op_{op}")(rng), 30)
                outcome = "ok"
            except CommandError as e:
                target, outcome = "", f"error:{e.code}"
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
        await self.client.instance_create(
            SILO, PROJECT, name, vcpus=rng.randint(1, 2), ram_bytes=GiB, disk_bytes=GiB, auto_restart=policy
        )
        return name

    async def op_start(self, rng: random.Random) -> str:
        name = self._pick_name(rng)
        await self.client.instance("start", SILO, PROJECT, name)
        return name

    async def op_stop(self, rng: random.Random) -> str:
        name = self._pick_name(rng)
        await self.client.instance("stop", SILO, PROJECT, name)
        return name

    async def op_migrate(self, rng: random.Random) -> str:
        name = self._pick_name(rng)
        await self.client.instance_migrate(SILO, PROJECT, name)
        return name

    async def op_delete(self, rng: random.Random) -> str:
        name = self._pick_name(rng)
        await self.client.instance("delete", SILO, PROJECT, name)
        return name

    async def op_pick(self, rng: random.Random) -> str:
        self._next += 1
        name = f"p-{self._next}"
        self.names.append(name)
        reply = await self.client.instance_from_pool(SILO, PROJECT, name, POOL)
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

    # --- the end of a run ---

    async def quiesce(self, settle_for: float = 120) -> None:
        """Lift every fault, let the system settle, then check every invariant."""
        for svc in self.stack.services.values():
            if not svc.alive:
                svc.start()
        await asyncio.to_thread(self.stack.wait_ready)
        await self.client.clear_faults()
        for sled in await self.client.sim_sled("list"):
            await self.client.sim_faults(SimFaults(sled_id=sled["sled_id"]))
            await self.client.sim_sled("heal", sled["sled_id"])
        deadline = time.monotonic() + settle_for
        while True:
            async with self.db.acquire() as conn:
                found = await check_each(conn, at_rest=True, js=self.client.nc.jetstream(), nc=self.client.nc)
            violations = [line for lines in found.values() for line in lines]
            if not violations or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        self.report.violations = violations
        self.report.invariants = {name: len(lines) for name, lines in found.items()}


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
