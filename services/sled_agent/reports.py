"""What a sled says: a report of each VMM change, sent until JetStream acknowledges it and only once the
change is on disk, its inventory, and the faults it can be told to inject into its reports."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from services.sled_agent.taken import CommandsTaken
from services.sled_agent.vmm import SimVmm, Timing
from shared import bus, telemetry, topology
from shared.messages import InventoryVmm, SimFaults, SledInventory, VmmReport
from shared.topology import subjects

log = logging.getLogger(__name__)
SOURCE = "sled-agent"


class Reporting:
    """A sled's reports and inventories; part of `Sled` (sled.py)."""

    sled_id: str
    boot_id: uuid.UUID
    boot_number: int
    nc: NATS
    js: JetStreamContext
    timing: Timing
    vmms: dict[uuid.UUID, SimVmm]
    faults: SimFaults | None
    reachable: bool
    reported_vcpus: int
    reported_ram_bytes: int
    commands: CommandsTaken
    _changes: int
    _thawed: asyncio.Event
    _connected: asyncio.Event
    next_seq: Callable[[], int]
    unsent: dict[uuid.UUID, VmmReport]
    _save: Callable[..., None]
    _spawn: Callable[[Any], None]
    _durable: Callable[[int], Any]

    def _report(self, vmm: SimVmm) -> None:
        self._send(self._new_report(vmm))

    def _new_report(self, vmm: SimVmm) -> VmmReport:
        """The VMM's report as of now. The report of a VMM that ended is kept in `unsent`, and written with
        the sled's state, until the broker acknowledges it: the VMM is in no other list, so a simulator
        that restarts sends that report again, where it would otherwise never be sent, and its instance
        would wait for it for ever (its sled lists the VMM no more: recovery calls that a late report)."""
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
        if vmm.state.terminal:
            self.unsent[vmm.vmm_id] = report
        return report

    def _send(self, report: VmmReport) -> None:
        """Send `report` once the sled's state as of now is on disk, until acknowledged."""
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
                    if self.unsent.get(report.vmm_id) is report:
                        del self.unsent[report.vmm_id]
                        self._save()  # with the next write: a restart before it only sends it again
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
                    vmm_id=v.vmm_id,
                    instance_id=v.instance_id,
                    state=v.state,
                    generation=v.generation,
                    since=datetime.fromtimestamp(v.since, UTC),
                )
                for v in self.vmms.values()
            ],
            commands_read=self.commands.read,
        )

    async def publish_inventory(self) -> None:
        if not self.reachable:
            return
        if self.commands.asking:  # not answered at start, or capped since: ask the broker (again)
            durable = topology.sled(self.sled_id)
            self._spawn(self.commands.ask_broker(self.js, durable.stream, durable.name))
        await bus.publish(
            self.js,
            subjects.sled_report(self.sled_id, "inventory"),
            self.inventory(),
            source=SOURCE,
            ttl=self.timing.inventory_ttl,
            acked=False,  # the next inventory supersedes it: no wait for its ack
        )
