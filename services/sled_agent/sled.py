"""One simulated sled: its VMMs' state machines, its reports, and the faults it can be told to inject.

Every VMM change bumps the VMM's generation and is reported; a report is retried until JetStream
acknowledges it, each attempt carrying the VMM's state as it is then. A VMM that reached a terminal state is
remembered, so that a late or repeated `ensure` never brings it back.

A migration is the one thing two sleds do together: the target VMM waits (`migrating`) for its source,
and the source, told to migrate, hands over to it directly (the simulator's sleds share a process, and
`peer` stands for the network between them); the target then runs and the source ends, reporting where
its instance went. A target that waits too long fails; a source whose target is gone, or never shows up,
runs on. The hand-over touches two sleds' files, written in this order, at once: the target's (running,
from that source) and then the source's (ended). The target's write is the commit point: a crash before
it leaves both as they were (the source resumes the hand-over, which it recorded with its target), a
crash after it leaves a source that, on loading, finds its target running from it and ends, so the
guest is on exactly one sled whatever the crash point. The other order would lose it on both sleds.

A sled keeps its state (boot number and id, VMMs) in a small file, so that a restart of the simulator
process is not a reboot of its sleds: same boot, same VMMs. The boot number only grows, by one at each
reboot, and every report and inventory carries it with a sequence number within the boot, so that a
receiver can tell an old message (a redelivery from before a reboot) from a new one; the boot id alone
could only say "different". The sled also keeps its boot history, the hardware's own record of when each
boot began, which the invariant checker holds the control plane's failures against. Changes are written
in batches (one write covers every change of the last few milliseconds, as a database's group commit
does), and a report leaves only once the state it reports is on disk: a sled never reports what a restart
would make it forget. A command is acknowledged only once its effect is on disk too (`persist`, before
the ack: a crash after the ack loses nothing, one before it has the command redelivered, and every
command is idempotent by VMM id). A reboot is something else: a new boot, and every VMM gone, without a
word about them (a real sled does not report what it lost). A rack-wide reboot writes every sled's new
boot in one file (`rack_boots`), not 5,000: each sled's own file catches up with its next change, and
loading takes the newer boot of the two.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from shared import bus, subjects, telemetry
from shared.config import inventory_ttl
from shared.crash import crash_point
from shared.messages import (
    InventoryVmm,
    SimFaults,
    SledInventory,
    VmmDestroy,
    VmmEnsure,
    VmmMigrate,
    VmmReport,
    VmmState,
    VmmStop,
)

log = logging.getLogger(__name__)
SOURCE = "sled-agent"
REMEMBERED_ENDED = 20_000
"""How many ended VMM ids a sled remembers, so that a late ensure for one is ignored."""
SAVE_BATCH = 0.02
"""Seconds a state change waits for others to share its write."""
SEQ_BLOCK = 10_000
"""Sequence numbers are reserved on disk a block at a time, so that a restarted simulator never reuses one
within a boot without writing its state for every message."""
REMEMBERED_BOOTS = 100
RACK_BOOTS = "rack-boots.json"
"""The new boot of every sled of the last rack-wide reboot, beside the sleds' own files."""


@dataclass
class SimVmm:
    vmm_id: uuid.UUID
    instance_id: uuid.UUID
    vcpus: int
    ram_bytes: int
    state: VmmState = VmmState.starting
    generation: int = 1
    migrate_from: uuid.UUID | None = None
    """A migration target: the source VMM it waits for."""
    migrated_to: uuid.UUID | None = None
    """A migration source that handed over: the VMM its instance went to."""
    target_sled_id: str | None = None
    target_vmm_id: uuid.UUID | None = None
    """A migration source handing over: where to (on disk, so that a restarted simulator finishes it)."""


@dataclass
class Timing:
    start_delay: float = 0.2
    stop_delay: float = 0.1
    report_retry: float = 1.0
    migrate_delay: float = 0.3
    migrate_timeout: float = 20.0


@dataclass
class Sled:
    sled_id: str
    vcpus: int
    ram_bytes: int
    nc: NATS
    """The sled's own connection (its own credential: identity.py)."""
    timing: Timing = field(default_factory=Timing)
    state_dir: Path | None = None
    boot_id: uuid.UUID = field(default_factory=uuid.uuid4)
    boot_number: int = 1
    boots: list[dict[str, Any]] = field(default_factory=list)
    """The boot history: {number, boot_id, started_at} for each boot, oldest first (the last REMEMBERED)."""
    seq: int = 0
    """The last sequence number used in this boot; numbers up to `seq_reserved` may be used unwritten."""
    seq_reserved: int = 0
    vmms: dict[uuid.UUID, SimVmm] = field(default_factory=dict)
    ended: dict[uuid.UUID, None] = field(default_factory=dict)
    faults: SimFaults | None = None
    capacity_vcpus: int | None = None
    capacity_ram_bytes: int | None = None
    """What the sled reports instead of `vcpus` and `ram_bytes` (made with), if set: rp.sim.sled.capacity."""
    peer: Callable[[str], Sled | None] | None = None
    """Another sled by id (None if there is no such sled): where a migration hands over to."""
    frozen: bool = False
    partitioned: bool = False
    _thawed: asyncio.Event = field(default_factory=asyncio.Event)
    _connected: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _changes: int = 0
    """State changes so far; `_saved` of them are on disk."""
    _saved: int = 0
    _on_disk: asyncio.Event = field(default_factory=asyncio.Event)
    naming: str | None = None
    """The name of the changes being made (a command's verb), for the crash points below."""
    _named: set[str] = field(default_factory=set)
    """Names of unwritten changes: the write that carries them passes `sled-agent:write:<name>` first."""
    _writer: asyncio.Task[None] | None = None
    js: JetStreamContext = field(init=False)

    def __post_init__(self) -> None:
        self.js = self.nc.jetstream()
        self._thawed.set()
        self._connected.set()
        if not self.boots:
            self._record_boot()

    def _record_boot(self) -> None:
        started = datetime.now(UTC).isoformat()
        self.boots.append({"number": self.boot_number, "boot_id": str(self.boot_id), "started_at": started})
        del self.boots[:-REMEMBERED_BOOTS]

    def next_seq(self) -> int:
        """The next sequence number of this boot (a block is reserved on disk before its first use)."""
        self.seq += 1
        if self.seq > self.seq_reserved:
            self.seq_reserved = self.seq + SEQ_BLOCK
            if self.state_dir is not None:
                self._write()
        return self.seq

    @property
    def reachable(self) -> bool:
        return not (self.frozen or self.partitioned)

    # --- commands ---

    async def ensure(self, cmd: VmmEnsure) -> None:
        if cmd.vmm_id in self.ended or cmd.vmm_id in self.vmms:
            telemetry.count("sled.ensure_repeated")
            return
        if self._drops_commands():
            return
        vmm = SimVmm(cmd.vmm_id, cmd.instance_id, cmd.vcpus, cmd.ram_bytes)
        if cmd.boot_number is not None and cmd.boot_number != self.boot_number:
            # Placed before this sled rebooted: that VMM can never start here.
            telemetry.count("sled.ensure_for_old_boot")
            self.vmms[vmm.vmm_id] = vmm
            self._transition(vmm, VmmState.failed)
            return
        if cmd.migrate_from is not None:
            vmm.state, vmm.migrate_from = VmmState.migrating, cmd.migrate_from.vmm_id
        self.vmms[vmm.vmm_id] = vmm
        self._save()
        self._report(vmm)
        self._spawn(self._await_handover(vmm) if vmm.migrate_from else self._finish_start(vmm))

    async def migrate(self, cmd: VmmMigrate) -> None:
        vmm = self.vmms.get(cmd.vmm_id)
        if vmm is None or vmm.state is not VmmState.running or self._drops_commands():
            return  # gone, not running, or handing over already (a repeated command)
        vmm.target_sled_id, vmm.target_vmm_id = cmd.target_sled_id, cmd.target_vmm_id
        self._transition(vmm, VmmState.migrating)
        self._spawn(self._hand_over(vmm))

    async def stop(self, cmd: VmmStop) -> None:
        vmm = self.vmms.get(cmd.vmm_id)
        if vmm is None or vmm.state is VmmState.stopping or self._drops_commands():
            return
        self._transition(vmm, VmmState.stopping)
        self._spawn(self._finish_stop(vmm))

    async def destroy(self, cmd: VmmDestroy) -> None:
        vmm = self.vmms.get(cmd.vmm_id)
        if vmm is None:
            self._forget(cmd.vmm_id)  # an ensure that arrives later must not start it
            self._save()
            return
        self._transition(vmm, VmmState.destroyed)

    def _drops_commands(self) -> bool:
        if self.faults is not None and self.faults.drop_commands:
            telemetry.count("sled.fault.command_dropped")
            return True
        return False

    async def _finish_start(self, vmm: SimVmm) -> None:
        await asyncio.sleep(self.timing.start_delay)
        await self._thawed.wait()
        if vmm.state is VmmState.starting and self.vmms.get(vmm.vmm_id) is vmm:
            crash = self.faults is not None and self.faults.fail_starts
            if crash:
                telemetry.count("sled.fault.failed_start")
            self._transition(vmm, VmmState.failed if crash else VmmState.running)

    async def _finish_stop(self, vmm: SimVmm) -> None:
        await asyncio.sleep(self.timing.stop_delay)
        await self._thawed.wait()
        if vmm.state is VmmState.stopping and self.vmms.get(vmm.vmm_id) is vmm:
            self._transition(vmm, VmmState.stopped)

    async def _hand_over(self, vmm: SimVmm) -> None:
        """Try until the target is there to take over, the target is gone, or time runs out."""
        deadline = asyncio.get_running_loop().time() + self.timing.migrate_timeout
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(self.timing.migrate_delay)
            await self._thawed.wait()
            if self.vmms.get(vmm.vmm_id) is not vmm or vmm.state is not VmmState.migrating:
                return  # destroyed, or lost in a reboot, meanwhile
            assert vmm.target_sled_id is not None and vmm.target_vmm_id is not None
            peer = self.peer(vmm.target_sled_id) if self.peer else None
            if peer is None or vmm.target_vmm_id in peer.ended:
                break  # the target is gone: nothing to hand over to
            target = peer.vmms.get(vmm.target_vmm_id)
            if not (self.reachable and peer.reachable) or target is None:
                continue  # not reachable, or not there yet
            if target.state is not VmmState.migrating or target.migrate_from != vmm.vmm_id:
                break
            # The hand-over itself: one step of the event loop, so neither side sees it half done, and
            # two writes, the target's first (the commit point: see the module's docstring).
            telemetry.count("sled.migrations")
            peer._transition(target, VmmState.running, now=True, name="handover-target")
            self._handed_over(vmm, target)
            return
        if self.vmms.get(vmm.vmm_id) is vmm and vmm.state is VmmState.migrating:
            telemetry.count("sled.migrations_abandoned")
            vmm.target_sled_id = vmm.target_vmm_id = None
            self._transition(vmm, VmmState.running)

    def _handed_over(self, vmm: SimVmm, target: SimVmm) -> None:
        """The source's end, once its target is on disk as running: written at once."""
        vmm.migrated_to = target.vmm_id
        self._transition(vmm, VmmState.destroyed, now=True, name="handover-source")

    def _resume_hand_over(self, vmm: SimVmm) -> bool:
        """A source found handing over after a restart: if its target's file says it took over (the crash
        came between the two writes), end, as the hand-over would have; else hand over again. True if it
        ended."""
        assert vmm.target_sled_id is not None
        peer = self.peer(vmm.target_sled_id) if self.peer else None
        target = peer.vmms.get(vmm.target_vmm_id) if peer is not None and vmm.target_vmm_id else None
        took_over = target is not None and target.state is not VmmState.migrating
        if target is not None and took_over and target.migrate_from == vmm.vmm_id:
            telemetry.count("sled.migrations_finished_on_resume")
            self._handed_over(vmm, target)
            return True
        self._spawn(self._hand_over(vmm))
        return False

    async def _await_handover(self, vmm: SimVmm) -> None:
        await asyncio.sleep(self.timing.migrate_timeout)
        await self._thawed.wait()
        if vmm.state is VmmState.migrating and self.vmms.get(vmm.vmm_id) is vmm:
            telemetry.count("sled.migrations_timed_out")
            self._transition(vmm, VmmState.failed)

    def _transition(self, vmm: SimVmm, state: VmmState, now: bool = False, name: str | None = None) -> None:
        vmm.state = state
        vmm.generation += 1
        if state.terminal:
            self.vmms.pop(vmm.vmm_id, None)
            self._forget(vmm.vmm_id)
        self._save(now, name)
        self._report(vmm)

    def _forget(self, vmm_id: uuid.UUID) -> None:
        self.ended[vmm_id] = None
        while len(self.ended) > REMEMBERED_ENDED:
            self.ended.pop(next(iter(self.ended)))

    # --- what the simulator's operator does to a sled ---

    def reboot(self, durable: bool = True) -> None:
        """Every VMM is lost; the sled comes back with a new boot id and nothing running. Written at once,
        for it is announced at once; `durable=False` leaves that to the caller (`rack_boots`)."""
        lost = len(self.vmms)
        self.boot_id = uuid.uuid4()
        self.boot_number += 1
        self.seq, self.seq_reserved = 0, SEQ_BLOCK  # the first block goes with the write below, not its own
        self._record_boot()
        for vmm_id in list(self.vmms):
            self._forget(vmm_id)
        self.vmms.clear()
        if durable:
            self._save(now=True)  # announced at once (its inventory): it must survive a simulator restart
        else:
            self._changes += 1  # on disk with the sled's next change; rack_boots holds it meanwhile
        telemetry.count("sled.reboots")
        log.info(
            "%s rebooted (boot %d, id %s): %d VMMs lost", self.sled_id, self.boot_number, self.boot_id, lost
        )

    def freeze(self) -> None:
        """Stop answering: no inventory, no reports, no commands taken, until thawed."""
        self.frozen = True
        self._thawed.clear()

    def thaw(self) -> None:
        self.frozen = False
        self._thawed.set()

    def partition(self, cut: bool) -> None:
        """Cut the sled off the network (or heal it): its VMMs go on, but nothing goes in or out."""
        self.partitioned = cut
        if cut:
            self._connected.clear()
        else:
            self._connected.set()

    def set_capacity(self, vcpus: int | None, ram_bytes: int | None) -> None:
        """Report this capacity from the next inventory on (None: what the sled was made with), as a sled
        that lost cores or DIMMs, or got them back, would. Written at once: it is announced at once."""
        self.capacity_vcpus, self.capacity_ram_bytes = vcpus, ram_bytes
        self._save(now=True)

    @property
    def reported_vcpus(self) -> int:
        return self.vcpus if self.capacity_vcpus is None else self.capacity_vcpus

    @property
    def reported_ram_bytes(self) -> int:
        return self.ram_bytes if self.capacity_ram_bytes is None else self.capacity_ram_bytes

    def shut_down(self) -> None:
        for t in [*self._tasks, self._writer]:
            if t is not None:
                t.cancel()
        if self.state_dir is not None:
            (self.state_dir / f"{self.sled_id}.json").unlink(missing_ok=True)
            self.state_dir = None  # gone for good: nothing of it is written again

    # --- reports ---

    def _report(self, vmm: SimVmm) -> None:
        report = VmmReport(
            sled_id=self.sled_id,
            boot_id=self.boot_id,
            boot_number=self.boot_number,
            seq=self.next_seq(),
            vmm_id=vmm.vmm_id,
            instance_id=vmm.instance_id,
            state=vmm.state,
            generation=vmm.generation,
            migrated_to=vmm.migrated_to,
        )
        self._spawn(self._deliver(report, self._changes))

    async def _deliver(self, report: VmmReport, change: int) -> None:
        """Send until acknowledged, once change number `change` is on disk. Each attempt is its own
        message: a retry is not a broker duplicate."""
        subject = subjects.sled_report(self.sled_id, "vmm")
        attempt = 0
        await self._durable(change)
        while True:
            await self._thawed.wait()
            await self._connected.wait()
            attempt += 1
            key = f"report:{report.vmm_id}:{report.generation}:{attempt}"
            fault = self._fault_for(report)
            if fault == "drop":
                telemetry.count("sled.fault.dropped")
            elif fault == "delay":
                telemetry.count("sled.fault.delayed")
                assert self.faults is not None
                self._spawn(self._publish_later(subject, report, key, self.faults.delay_seconds))
            else:
                try:
                    await bus.publish(self.js, subject, report, source=SOURCE, key=key)
                    for i in range(self.faults.duplicate if self.faults else 0):
                        telemetry.count("sled.fault.duplicated")
                        await bus.publish(self.js, subject, report, source=SOURCE, key=f"{key}:dup{i}")
                    telemetry.count("sled.reports")
                    return
                except Exception as e:
                    log.info(
                        "%s: report of %s not acknowledged (%s); retrying", self.sled_id, report.vmm_id, e
                    )
            await asyncio.sleep(self.timing.report_retry)

    def _fault_for(self, report: VmmReport) -> str | None:
        f = self.faults
        if f is None:
            return None
        if f.delay_count > 0 and (f.delay_state is None or f.delay_state == report.state):
            self.faults = f.model_copy(update={"delay_count": f.delay_count - 1})
            return "delay"
        if f.drop_probability and random.random() < f.drop_probability:
            return "drop"
        return None

    async def _publish_later(self, subject: str, report: VmmReport, key: str, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await bus.publish(self.js, subject, report, source=SOURCE, key=key)
            telemetry.count("sled.fault.delayed_delivered")
        except Exception as e:
            log.info("%s: delayed report lost: %s", self.sled_id, e)

    def inventory(self) -> SledInventory:
        return SledInventory(
            sled_id=self.sled_id,
            boot_id=self.boot_id,
            boot_number=self.boot_number,
            seq=self.next_seq(),
            vcpus=self.reported_vcpus,
            ram_bytes=self.reported_ram_bytes,
            vmms=[
                InventoryVmm(
                    vmm_id=v.vmm_id, instance_id=v.instance_id, state=v.state, generation=v.generation
                )
                for v in self.vmms.values()
            ],
        )

    async def publish_inventory(self) -> None:
        if not self.reachable:
            return
        await bus.post(
            self.nc,
            subjects.sled_report(self.sled_id, "inventory"),
            self.inventory(),
            source=SOURCE,
            ttl=inventory_ttl(),
        )

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # --- persistence across simulator restarts ---

    def _save(self, now: bool = False, name: str | None = None) -> None:
        """Count a state change; write it with the next batch (`now`: before returning)."""
        self._changes += 1
        if (name := name or self.naming) is not None and self.state_dir is not None:
            self._named.add(name)  # a command's verb, `handover-target`, `handover-source`
        if self.state_dir is None:
            self._saved = self._changes
        elif now:
            self._write()
        elif self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_batches())

    async def _write_batches(self) -> None:
        while self._saved < self._changes:
            await asyncio.sleep(SAVE_BATCH)
            self._write()

    def persist(self) -> None:
        """Write every change so far now, if any is not on disk yet: what a command did, before its ack.
        Not batched: the sled takes one command at a time, so a batch would only delay the ack."""
        if self.state_dir is not None and self._saved < self._changes:
            self._write()

    async def _durable(self, change: int) -> None:
        while self._saved < change:
            self._on_disk.clear()
            await self._on_disk.wait()

    def _write(self) -> None:
        assert self.state_dir is not None
        change = self._changes
        for name in self._named:  # every named change so far: this write carries them all
            crash_point(f"sled-agent:write:{name}")
        self._named.clear()
        state = {
            "sled_id": self.sled_id,
            "vcpus": self.vcpus,
            "ram_bytes": self.ram_bytes,
            "capacity": [self.capacity_vcpus, self.capacity_ram_bytes],
            "boot_id": str(self.boot_id),
            "boot_number": self.boot_number,
            "seq_reserved": self.seq_reserved,
            "boots": self.boots,
            "vmms": [
                {
                    "vmm_id": str(v.vmm_id),
                    "instance_id": str(v.instance_id),
                    "vcpus": v.vcpus,
                    "ram_bytes": v.ram_bytes,
                    "state": v.state.value,
                    "generation": v.generation,
                    "migrate_from": str(v.migrate_from) if v.migrate_from else None,
                    "target_sled_id": v.target_sled_id,
                    "target_vmm_id": str(v.target_vmm_id) if v.target_vmm_id else None,
                }
                for v in self.vmms.values()
            ],
            "ended": [str(v) for v in self.ended],
        }
        _replace(self.state_dir / f"{self.sled_id}.json", state)
        self._saved = change
        self._on_disk.set()

    def boot_record(self) -> dict[str, Any]:
        return {**self.boots[-1], "seq_reserved": self.seq_reserved}

    @classmethod
    def load(cls, path: Path, nc: NATS, timing: Timing, rack_boot: dict[str, Any] | None = None) -> Sled:
        """The sled as its file left it, or, if the last rack-wide reboot (`rack_boot`, from rack_boots)
        came after that file was written, as that reboot left it."""
        state = json.loads(path.read_text())
        if rack_boot is not None and rack_boot["number"] > state.get("boot_number", 1):
            ended = [v["vmm_id"] for v in state["vmms"]]
            state |= {
                "boot_id": rack_boot["boot_id"],
                "boot_number": rack_boot["number"],
                "seq_reserved": rack_boot["seq_reserved"],
                "boots": [
                    *state.get("boots", []),
                    {k: rack_boot[k] for k in ("number", "boot_id", "started_at")},
                ][-REMEMBERED_BOOTS:],
                "vmms": [],
                "ended": [*state["ended"], *ended],
            }
        sled = cls(state["sled_id"], state["vcpus"], state["ram_bytes"], nc, timing, path.parent)
        sled.boot_id = uuid.UUID(state["boot_id"])
        sled.boot_number = state.get("boot_number", 1)
        sled.seq = sled.seq_reserved = state.get("seq_reserved", 0)  # never reuse one handed out before
        sled.boots = state.get("boots") or sled.boots
        sled.capacity_vcpus, sled.capacity_ram_bytes = state.get("capacity") or (None, None)
        for v in state["vmms"]:
            vmm = SimVmm(
                uuid.UUID(v["vmm_id"]),
                uuid.UUID(v["instance_id"]),
                v["vcpus"],
                v["ram_bytes"],
                VmmState(v["state"]),
                v["generation"],
                uuid.UUID(v["migrate_from"]) if v.get("migrate_from") else None,
                target_sled_id=v.get("target_sled_id"),
                target_vmm_id=uuid.UUID(v["target_vmm_id"]) if v.get("target_vmm_id") else None,
            )
            sled.vmms[vmm.vmm_id] = vmm
        sled.ended = {uuid.UUID(v): None for v in state["ended"]}
        return sled

    def resume(self) -> None:
        """After a simulator restart: finish what was under way, and report every VMM's state again. Every
        sled is loaded before any resumes: a migration source looks at its target's sled."""
        for vmm in list(self.vmms.values()):
            if vmm.state is VmmState.migrating and vmm.target_vmm_id is not None:
                if self._resume_hand_over(vmm):
                    continue  # ended, and reported so
            self._report(vmm)
            if vmm.state is VmmState.starting:
                self._spawn(self._finish_start(vmm))
            elif vmm.state is VmmState.stopping:
                self._spawn(self._finish_stop(vmm))
            elif vmm.state is VmmState.migrating and vmm.migrate_from is not None:
                self._spawn(self._await_handover(vmm))
            elif vmm.state is VmmState.migrating and vmm.target_vmm_id is None:
                self._transition(vmm, VmmState.running)  # a file from before targets were kept: run on

    def describe(self) -> dict[str, Any]:
        return {
            "sled_id": self.sled_id,
            "boot_id": str(self.boot_id),
            "boot_number": self.boot_number,
            "boots": self.boots,
            "vcpus": self.reported_vcpus,
            "ram_bytes": self.reported_ram_bytes,
            "nominal_vcpus": self.vcpus,
            "nominal_ram_bytes": self.ram_bytes,
            "frozen": self.frozen,
            "partitioned": self.partitioned,
            "vmms": len(self.vmms),
            "faults": self.faults.model_dump(mode="json") if self.faults else None,
        }


def rack_boots(state_dir: Path | None, sleds: list[Sled]) -> None:
    """Write the new boot of every sled of a rack-wide reboot, in one file (each sled's own file follows
    with its next change): a simulator restarted in between still knows every sled rebooted."""
    if state_dir is None:
        return
    _replace(state_dir / RACK_BOOTS, {s.sled_id: s.boot_record() for s in sleds})


def read_rack_boots(state_dir: Path) -> dict[str, dict[str, Any]]:
    path = state_dir / RACK_BOOTS
    return json.loads(path.read_text()) if path.exists() else {}


def _replace(path: Path, state: dict[str, Any]) -> None:
    """Write `state` as the whole of `path`, or not at all (a crash mid-write leaves the old file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
