"""Recovery's orders to instance-manager (request/reply, on the fleet's subjects).

An order is a condition: each names what recovery saw, and instance-manager applies it only if all of
that still holds under its own row locks; otherwise it answers `stale` and changes nothing. They are
kept together, apart from the operator's commands, because that fence is what they share
(services/instance_manager/orders.py applies them).
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import Field, model_validator

from shared.messages.base import BootNumber, Generation, Model, Name, message


@message("rp.cmd.vmm.lost")
class VmmLost(Model):
    """The VMM was placed on boot `vmm_boot` of its sled, and the sled has since come back on boot
    `sled_boot`: a reboot took it. Applied only while the instance is at `generation` with this VMM
    active (or as its migration target) and instance-manager itself has seen that later boot."""

    instance_id: uuid.UUID
    generation: Generation
    vmm_id: uuid.UUID
    sled_id: Name
    vmm_boot: BootNumber
    sled_boot: BootNumber

    @model_validator(mode="after")
    def _later_boot(self) -> VmmLost:
        if self.sled_boot <= self.vmm_boot:
            raise ValueError("sled_boot must be later than vmm_boot: only a later boot proves a VMM lost")
        return self


LOST_BATCH = 1000
"""The most VMMs one `rp.cmd.vmm.lost` v2 names (about 160 KB of JSON: far below the broker's limit)."""


class LostVmm(Model):
    """One VMM of a `rp.cmd.vmm.lost` v2: what recovery saw of it."""

    instance_id: uuid.UUID
    generation: Generation
    vmm_id: uuid.UUID
    vmm_boot: BootNumber


@message("rp.cmd.vmm.lost", 2)
class VmmLostV2(Model):
    """Sled `sled_id` has come back on boot `sled_boot`, and these VMMs were placed on earlier boots of it:
    the reboot took them. One order for up to LOST_BATCH of them (v1 names one), so that a sled's reboot
    is repaired in one transaction; each VMM is applied, or refused as stale, on its own, under the same
    conditions as v1."""

    sled_id: Name
    sled_boot: BootNumber
    vmms: list[LostVmm] = Field(min_length=1, max_length=LOST_BATCH)

    @model_validator(mode="after")
    def _later_boot(self) -> VmmLostV2:
        if any(self.sled_boot <= v.vmm_boot for v in self.vmms):
            raise ValueError(
                "sled_boot must be later than every vmm_boot: only a later boot proves a VMM lost"
            )
        if len({v.vmm_id for v in self.vmms}) != len(self.vmms):
            raise ValueError("a VMM is named twice")
        return self

    @classmethod
    def of(cls, v1: VmmLost) -> VmmLostV2:
        """A v1 order, as the v2 order of one VMM."""
        vmm = LostVmm(
            instance_id=v1.instance_id, generation=v1.generation, vmm_id=v1.vmm_id, vmm_boot=v1.vmm_boot
        )
        return cls(sled_id=v1.sled_id, sled_boot=v1.sled_boot, vmms=[vmm])


@message("rp.cmd.vmm.stuck")
class VmmStuck(Model):
    """The instance has been `state` (starting, stopping or migrating) past the transition timeout on a
    sled that answers, and that sled's latest inventory, made past the timeout after it was asked, does
    not show what the instance waits for (`shows_awaited`). Applied only while all of that still holds
    by instance-manager's own clock, records and inventories, at `generation`; for a migration, `vmm_id`
    is the target, and the move is called off."""

    instance_id: uuid.UUID
    generation: Generation
    vmm_id: uuid.UUID
    state: Literal["starting", "stopping", "migrating"]


def shows_awaited(state: str, shown: str | None) -> bool:
    """Whether a sled's inventory that lists an instance's VMM as `shown` (None: not listed; a sled lists
    only the VMMs it has not ended) shows what the instance, `state`, waits for: the VMM running, for a
    start or a migration's target; gone, for a stop. If it does, the VMM is not stuck: its report is
    late. The one rule for recovery's stuck orders and instance-manager's check of them."""
    if state == "stopping":
        return shown is None or shown in ("stopped", "failed", "destroyed")
    return shown == "running"


@message("rp.cmd.vmm.zombie")
class VmmZombie(Model):
    """Sled `sled_id` runs this VMM and no instance expects it. instance-manager destroys it only if no
    instance names it as active or target and it has been unclaimed past the grace period by its own
    records and clock."""

    vmm_id: uuid.UUID
    sled_id: Name


@message("rp.cmd.instance.restart")
class InstanceRestart(Model):
    """Start a failed instance again, by its auto-restart policy, unless it changed since `generation`."""

    instance_id: uuid.UUID
    generation: Generation


@message("rp.cmd.instance.settle")
class InstanceSettle(Model):
    """Bring a failed instance that will not be restarted to stopped, unless it changed since `generation`."""

    instance_id: uuid.UUID
    generation: Generation
