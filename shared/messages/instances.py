"""Instances: their states, the view every instance event carries, and the operator's commands on them
(request/reply, rp.cmd.<silo>.instance.<verb>).

What a sled is told to run for an instance (its VMMs) is in `sleds`; recovery's orders about failed
instances are in `orders`.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import model_validator

from shared.messages.base import BootNumber, DiskBytes, Event, Model, Name, RamBytes, Vcpus, message
from shared.messages.paging import Paged


class InstanceState(StrEnum):
    creating = "creating"
    stopped = "stopped"
    starting = "starting"
    running = "running"
    stopping = "stopping"
    migrating = "migrating"
    failed = "failed"
    destroyed = "destroyed"


CHARGED_STATES = frozenset(
    {InstanceState.starting, InstanceState.running, InstanceState.stopping, InstanceState.migrating}
)
"""An instance in one of these states has a live VMM, and so holds a vCPU/RAM charge."""


class AutoRestart(StrEnum):
    best_effort = "best_effort"
    never = "never"


class InstanceView(Event):
    id: uuid.UUID
    silo: Name
    project: Name
    name: Name
    silo_id: uuid.UUID
    project_id: uuid.UUID
    vcpus: int
    ram_bytes: int
    disk_bytes: int
    auto_restart: AutoRestart
    state: InstanceState
    """As far as instance-manager knows now: an instance whose VMM's sled has since come back on a later
    boot is `failed` (`stopped`, if it was stopping) from the moment that boot's inventory is applied,
    before recovery's order records it (and bumps the generation)."""
    intended_state: Literal["running", "stopped"]
    generation: int
    active_vmm_id: uuid.UUID | None
    sled_id: str | None
    vmm_boot_id: uuid.UUID | None
    vmm_boot_number: int | None = None
    """The boot of its sled that the active VMM was placed on: it cannot outlive that boot."""
    target_vmm_id: uuid.UUID | None = None
    """While migrating: the VMM the instance is moving to (it runs on `sled_id` until the move is done)."""
    target_sled_id: str | None = None
    target_vmm_boot_id: uuid.UUID | None = None
    target_vmm_boot_number: int | None = None
    health: Literal["ok", "unknown", "failed"]
    """`unknown`: its sled has gone quiet. Such an instance is neither failed nor restarted. `failed`: it
    failed, or its sled has rebooted since its VMM was placed."""
    last_error: str | None = None
    failed_at: datetime | None = None
    auto_restarts: int = 0
    last_auto_restart_at: datetime | None = None
    next_restart_at: datetime | None = None
    pool: str | None = None
    """The warm pool this VM came from (still idle in it while has_customer_data_at is unset)."""
    provisioned_at: datetime | None = None
    has_customer_data_at: datetime | None = None
    """Since when the VM may hold customer data; once set, never handed out from a pool again."""
    updated_at: datetime


@message("rp.evt.instance.changed")
class InstanceChanged(Event):
    instance: InstanceView


class InstanceViewV2(InstanceView):
    """The instance view of `rp.evt.instance.changed` v2: the boots its VMMs were placed on are always
    there. A VMM cannot outlive the boot of its sled it was placed on, and that is how recovery tells a
    VMM lost in a reboot; with v1's optional boot numbers, a message without them was read as "no boot
    known" and the lost VMM was never found. v2 refuses such a message instead."""

    vmm_boot_number: BootNumber | None
    """Required; null only without a VMM placed on a sled (`sled_id` null)."""
    target_vmm_boot_number: BootNumber | None
    """Required; null only without a migration target placed on a sled (`target_sled_id` null)."""

    @model_validator(mode="after")
    def _placed_on_a_boot(self) -> InstanceViewV2:
        if self.sled_id is not None and self.vmm_boot_number is None:
            raise ValueError("vmm_boot_number is required with a sled_id")
        if self.target_sled_id is not None and self.target_vmm_boot_number is None:
            raise ValueError("target_vmm_boot_number is required with a target_sled_id")
        return self


@message("rp.evt.instance.changed", 2)
class InstanceChangedV2(Event):
    """An instance changed (v2): as v1, with the boot numbers of its VMMs required."""

    instance: InstanceViewV2


class InstanceRef(Model):
    silo: Name
    project: Name
    name: Name


@message("rp.cmd.instance.create")
class InstanceCreate(Model):
    """Create an instance. With `from_pool`, take an idle VM of that pool (same project) instead, running
    already; if the pool has none, create and start a new one of the pool's shape, unless `require_pool`."""

    silo: Name
    project: Name
    name: Name
    vcpus: Vcpus | None = None
    ram_bytes: RamBytes | None = None
    disk_bytes: DiskBytes | None = None
    auto_restart: AutoRestart = AutoRestart.best_effort
    from_pool: Name | None = None
    require_pool: bool = False

    @model_validator(mode="after")
    def _shape_or_pool(self) -> InstanceCreate:
        shape = (self.vcpus, self.ram_bytes, self.disk_bytes)
        if self.from_pool is None and None in shape:
            raise ValueError("vcpus, ram_bytes and disk_bytes are required (or from_pool)")
        if self.from_pool is not None and shape != (None, None, None):
            raise ValueError("a VM from a pool has the pool's shape: give from_pool or a shape, not both")
        if self.require_pool and self.from_pool is None:
            raise ValueError("require_pool needs from_pool")
        return self


@message("rp.cmd.instance.start")
class InstanceStart(InstanceRef):
    pass


@message("rp.cmd.instance.stop")
class InstanceStop(InstanceRef):
    pass


@message("rp.cmd.instance.migrate")
class InstanceMigrate(InstanceRef):
    """Move a running instance to another sled (`to_sled`, or the least loaded one with room) without
    stopping it. Its charge does not change; it holds room on both sleds until the move ends."""

    to_sled: Name | None = None


@message("rp.cmd.instance.delete")
class InstanceDelete(InstanceRef):
    pass


@message("rp.cmd.instance.show")
class InstanceShow(InstanceRef):
    pass


@message("rp.cmd.instance.list")
class InstanceList(Paged):
    silo: Name | None = None
    project: Name | None = None
