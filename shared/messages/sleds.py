"""Sleds and the VMMs they run: instance-manager's commands to a sled (JetStream,
rp.sled.<sled>.cmd.vmm.*), a sled's reports and inventories (JetStream, rp.sled.<sled>.report.*), the sled
view its events carry, and the operator's sled commands.

Together so that everything a sled is told or says, and everything said about a sled, is in one place. A
sled knows VMMs only, never instances, silos or charges.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum

from shared.messages.base import (
    BootNumber,
    Event,
    Generation,
    InstanceRam,
    InstanceVcpus,
    Model,
    Name,
    Sequence,
    SledRam,
    SledVcpus,
    message,
)
from shared.messages.paging import Paged


class VmmState(StrEnum):
    starting = "starting"
    running = "running"
    migrating = "migrating"
    """A source VMM handing its instance over, or a target VMM waiting to take it."""
    stopping = "stopping"
    stopped = "stopped"
    failed = "failed"
    destroyed = "destroyed"

    @property
    def terminal(self) -> bool:
        """A VMM in a terminal state never comes back: its sled has let go of it for good."""
        return self in (VmmState.stopped, VmmState.failed, VmmState.destroyed)


# --- commands to sleds (JetStream, rp.sled.<sled>.cmd.*) ----------------------------------------------


class MigrationSource(Model):
    vmm_id: uuid.UUID
    sled_id: Name


@message("rp.sled.vmm.ensure")
class VmmEnsure(Model):
    """Run this VMM. Idempotent: a VMM the sled already runs, or has already ended, is left as it is."""

    vmm_id: uuid.UUID
    instance_id: uuid.UUID
    vcpus: InstanceVcpus
    ram_bytes: InstanceRam
    boot_number: BootNumber | None = None
    """The sled's boot when the VMM was placed: a sled on a later boot fails the VMM at once."""
    migrate_from: MigrationSource | None = None
    """Set for a migration target: the VMM waits (state `migrating`) for this source to hand over."""


@message("rp.sled.vmm.stop")
class VmmStop(Model):
    vmm_id: uuid.UUID


@message("rp.sled.vmm.migrate")
class VmmMigrate(Model):
    """Hand the running VMM's instance over to `target_vmm_id` on `target_sled_id`. Idempotent. On
    success the source ends (`destroyed`, with `migrated_to` set) and the target runs; if the target is
    gone or never shows up, the source goes back to running."""

    vmm_id: uuid.UUID
    target_vmm_id: uuid.UUID
    target_sled_id: Name


@message("rp.sled.vmm.destroy")
class VmmDestroy(Model):
    """Tear the VMM down whatever its state (undo of a start, or a zombie)."""

    vmm_id: uuid.UUID


# --- reports from sleds (JetStream, rp.sled.<sled>.report.*) ------------------------------------------


@message("rp.sled.vmm.report")
class VmmReport(Model):
    sled_id: Name
    boot_id: uuid.UUID
    boot_number: BootNumber
    seq: Sequence
    vmm_id: uuid.UUID
    instance_id: uuid.UUID
    state: VmmState
    generation: Generation
    migrated_to: uuid.UUID | None = None
    """On a source VMM's terminal report: the VMM its instance now runs on."""


class InventoryVmm(Model):
    vmm_id: uuid.UUID
    instance_id: uuid.UUID
    state: VmmState
    generation: Generation
    since: datetime | None = None
    """When the VMM took its state, by the sled's clock: how long a start has been booting on the sled
    (not how long ago it was asked) is what a stuck order judges."""


@message("rp.sled.inventory")
class SledInventory(Model):
    """Everything a sled runs, as of (boot_number, seq): applied only if newer than what is held."""

    sled_id: Name
    boot_id: uuid.UUID
    boot_number: BootNumber
    seq: Sequence
    vcpus: SledVcpus
    ram_bytes: SledRam
    vmms: list[InventoryVmm]
    commands_read: Sequence | None = None
    """The stream sequence up to which the sled has taken every command on its subject (None: it does
    not say): an order stored after it is still waiting, and a VMM it asks for is not missing."""

    @staticmethod
    def newest(invs: list[SledInventory]) -> list[SledInventory]:
        """Of each sled's inventories, the newest by (boot number, sequence), in sled id order: a batch
        applies one per sled, and the fence would refuse the older ones anyway."""
        out: dict[str, SledInventory] = {}
        for inv in invs:
            held = out.get(inv.sled_id)
            if held is None or (held.boot_number, held.seq) < (inv.boot_number, inv.seq):
                out[inv.sled_id] = inv
        return [out[k] for k in sorted(out)]


# --- the sled view (events), and the operator's sled commands -----------------------------------------


class SledView(Event):
    id: str
    state: str
    boot_id: uuid.UUID | None
    boot_number: int | None = None
    vcpus: int
    ram_bytes: int
    reserved_vcpus: int
    reserved_ram_bytes: int
    vmms: int
    last_seen_at: datetime | None


@message("rp.evt.sled.changed")
class SledChanged(Event):
    sled: SledView


@message("rp.cmd.sled.list")
class SledList(Paged):
    pass


@message("rp.cmd.sled.expunge")
class SledExpunge(Model):
    """The sled is gone for good: never placed on again; its instances fail (and restart by policy)."""

    sled_id: Name
