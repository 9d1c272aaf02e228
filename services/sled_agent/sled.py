"""One simulated sled: its VMMs' state machines, its reports, and the faults it can be told to inject.

Every VMM change bumps the VMM's generation and is reported; a report is retried until JetStream
acknowledges it, each attempt carrying the VMM's state as it is then. A VMM that reached a terminal state is
remembered, so that a late or repeated `ensure` never brings it back.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from dataclasses import dataclass, field

from nats.js import JetStreamContext

from shared import bus, subjects, telemetry
from shared.messages import (
    InventoryVmm,
    SimFaults,
    SledInventory,
    VmmDestroy,
    VmmEnsure,
    VmmReport,
    VmmState,
    VmmStop,
)

log = logging.getLogger(__name__)
SOURCE = "sled-agent"


@dataclass
class SimVmm:
    vmm_id: uuid.UUID
    instance_id: uuid.UUID
    vcpus: int
    ram_bytes: int
    state: VmmState = VmmState.starting
    generation: int = 1


@dataclass
class Timing:
    start_delay: float = 0.2
    stop_delay: float = 0.1
    report_retry: float = 1.0


@dataclass
class Sled:
    sled_id: str
    vcpus: int
    ram_bytes: int
    js: JetStreamContext
    timing: Timing = field(default_factory=Timing)
    boot_id: uuid.UUID = field(default_factory=uuid.uuid4)
    vmms: dict[uuid.UUID, SimVmm] = field(default_factory=dict)
    ended: set[uuid.UUID] = field(default_factory=set)
    faults: SimFaults | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    # --- commands ---

    async def ensure(self, cmd: VmmEnsure) -> None:
        if cmd.vmm_id in self.ended:
            telemetry.count("sled.ensure_ended_ignored")
            return
        if cmd.vmm_id in self.vmms:
            return
        vmm = SimVmm(cmd.vmm_id, cmd.instance_id, cmd.vcpus, cmd.ram_bytes)
        self.vmms[vmm.vmm_id] = vmm
        self._report(vmm)
        self._spawn(self._finish_start(vmm))

    async def stop(self, cmd: VmmStop) -> None:
        vmm = self.vmms.get(cmd.vmm_id)
        if vmm is None or vmm.state in (VmmState.stopping,):
            return
        self._transition(vmm, VmmState.stopping)
        self._spawn(self._finish_stop(vmm))

    async def destroy(self, cmd: VmmDestroy) -> None:
        vmm = self.vmms.get(cmd.vmm_id)
        if vmm is None:
            self.ended.add(cmd.vmm_id)  # an ensure that arrives later must not start it
            return
        self._transition(vmm, VmmState.destroyed)

    async def _finish_start(self, vmm: SimVmm) -> None:
        await asyncio.sleep(self.timing.start_delay)
        if vmm.state is VmmState.starting and self.vmms.get(vmm.vmm_id) is vmm:
            self._transition(vmm, VmmState.running)

    async def _finish_stop(self, vmm: SimVmm) -> None:
        await asyncio.sleep(self.timing.stop_delay)
        if vmm.state is VmmState.stopping and self.vmms.get(vmm.vmm_id) is vmm:
            self._transition(vmm, VmmState.stopped)

    def _transition(self, vmm: SimVmm, state: VmmState) -> None:
        vmm.state = state
        vmm.generation += 1
        if state.terminal:
            self.vmms.pop(vmm.vmm_id, None)
            self.ended.add(vmm.vmm_id)
        self._report(vmm)

    # --- reports ---

    def _report(self, vmm: SimVmm) -> None:
        report = VmmReport(
            sled_id=self.sled_id,
            boot_id=self.boot_id,
            vmm_id=vmm.vmm_id,
            instance_id=vmm.instance_id,
            state=vmm.state,
            generation=vmm.generation,
        )
        self._spawn(self._deliver(report))

    async def _deliver(self, report: VmmReport) -> None:
        """Send until acknowledged. Each attempt is its own message: a retry is not a broker duplicate."""
        subject = subjects.sled_report(self.sled_id, "vmm")
        attempt = 0
        while True:
            attempt += 1
            key = f"report:{report.vmm_id}:{report.generation}:{attempt}"
            fault = self._fault_for(report)
            if fault == "drop":
                telemetry.count("sled.fault.dropped")
            elif fault == "delay":
                telemetry.count("sled.fault.delayed")
                self._spawn(self._publish_later(subject, report, key, self.faults.delay_seconds))  # type: ignore[union-attr]
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
            vcpus=self.vcpus,
            ram_bytes=self.ram_bytes,
            vmms=[
                InventoryVmm(
                    vmm_id=v.vmm_id, instance_id=v.instance_id, state=v.state, generation=v.generation
                )
                for v in self.vmms.values()
            ],
        )

    async def publish_inventory(self) -> None:
        await bus.publish(
            self.js, subjects.sled_report(self.sled_id, "inventory"), self.inventory(), source=SOURCE
        )

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
