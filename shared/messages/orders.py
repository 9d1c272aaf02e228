"""Recovery's orders to instance-manager (request/reply, on the fleet's subjects).

An order is a condition: each names what recovery saw, and instance-manager applies it only if all of
that still holds under its own row locks; otherwise it answers `stale` and changes nothing. They are
kept together, apart from the operator's commands, because that fence is what they share
(services/instance_manager/orders.py applies them).
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import model_validator

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


@message("rp.cmd.vmm.stuck")
class VmmStuck(Model):
    """The instance has been `state` (starting, stopping or migrating) past the transition timeout on a
    sled that answers. Applied only while it is still so, at `generation`, by instance-manager's own clock
    and records; for a migration, `vmm_id` is the target, and the move is called off."""

    instance_id: uuid.UUID
    generation: Generation
    vmm_id: uuid.UUID
    state: Literal["starting", "stopping", "migrating"]


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
