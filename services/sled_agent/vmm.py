"""A simulated VMM and its state machine on a sled: ensure, stop, destroy and live migration.

A migration is the one thing two sleds do together: the target VMM waits (`migrating`) for its source,
and the source, told to migrate, hands over to it directly (the simulator's sleds share a process, and
`peer` stands for the network between them); the target then runs and the source ends, reporting where
its instance went. A target that waits too long fails; a source whose target is gone, or never shows up,
runs on. The hand-over touches two sleds' files, written in this order, at once: the target's (running,
from that source) and then the source's (ended). The target's write is the commit point: a crash before
it leaves both as they were (the source resumes the hand-over, which it recorded with its target), a
crash after it leaves a source that, on loading, finds its target running from it and ends, so the
guest is on exactly one sled whatever the crash point. The other order would lose it on both sleds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared import telemetry
from shared.messages import SimFaults, VmmDestroy, VmmEnsure, VmmMigrate, VmmReport, VmmState, VmmStop

REMEMBERED_ENDED = 20_000
"""How many ended VMM ids a sled remembers, so that a late ensure for one is ignored."""


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
    since: float = field(default_factory=time.time)
    """When it took its state, by the sled's clock (its inventory's `since`)."""


@dataclass
class Timing:
    start_delay: float = 0.2
    stop_delay: float = 0.1
    report_retry: float = 1.0
    migrate_delay: float = 0.3
    migrate_timeout: float = 20.0
    inventory_ttl: float = 60.0
    """How long the broker keeps each inventory (Settings.inventory_keep)."""


class VmmMachine:
    """The VMM commands a sled takes and the transitions they lead to; part of `Sled` (sled.py), whose
    reports (reports.py) and state file (persistence.py) each transition goes through."""

    sled_id: str
    boot_number: int
    timing: Timing
    vmms: dict[uuid.UUID, SimVmm]
    ended: dict[uuid.UUID, None]
    faults: SimFaults | None
    peer: Callable[[str], Any] | None
    _thawed: asyncio.Event
    reachable: bool
    _save: Callable[..., None]
    _report: Callable[[SimVmm], None]
    _new_report: Callable[[SimVmm], VmmReport]
    _send: Callable[[VmmReport], None]
    _spawn: Callable[[Any], None]

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
        vmm.state, vmm.since = state, time.time()
        vmm.generation += 1
        if state.terminal:
            self.vmms.pop(vmm.vmm_id, None)
            self._forget(vmm.vmm_id)
        report = self._new_report(vmm)  # before the write: an ended VMM's report is kept with it
        self._save(now, name)
        self._send(report)

    def _forget(self, vmm_id: uuid.UUID) -> None:
        self.ended[vmm_id] = None
        while len(self.ended) > REMEMBERED_ENDED:
            self.ended.pop(next(iter(self.ended)))
