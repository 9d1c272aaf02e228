"""Simulator control (request/reply, rp.sim.*): what an operator or a test asks of sled-agent's simulated
sleds (faults, reboots, freezes, partitions, capacity, adding and removing sleds).

Apart from the sled schemas because a real sled would take none of these: they exist only to put the
control plane under the failures a rack has.
"""

from __future__ import annotations

from pydantic import Field

from shared.messages.base import (
    Copies,
    Model,
    Name,
    Probability,
    ReportDelayCount,
    ReportDelaySeconds,
    SimSledRam,
    SledRam,
    SledVcpus,
    message,
)
from shared.messages.sleds import VmmState


@message("rp.sim.faults.set")
class SimFaults(Model):
    """Faults a simulated sled applies to its own outgoing reports, until changed."""

    sled_id: Name
    delay_state: VmmState | None = None
    delay_seconds: ReportDelaySeconds = 0
    delay_count: ReportDelayCount = 0
    duplicate: Copies = 0
    drop_probability: Probability = 0
    drop_commands: bool = False
    """Take commands off the stream but do nothing with them: a sled that never answers a start or stop."""
    fail_starts: bool = False
    """Every VMM that boots fails at once instead of running: a crash loop."""
    hold_commands_seconds: ReportDelaySeconds = Field(0, exclude_if=lambda held: not held)
    """Take no command younger than this (by its time on the stream): a sled whose command consumer lags,
    its orders waiting unread while its inventories go out as usual. Sent only when set, so that a
    simulator of an earlier release still takes the faults it knows."""


@message("rp.sim.sled.list")
class SimSledList(Model):
    pass


class SimSledRef(Model):
    sled_id: Name


@message("rp.sim.sled.reboot")
class SimSledReboot(SimSledRef):
    pass


@message("rp.sim.rack.reboot")
class SimRackReboot(Model):
    """Every simulated sled reboots at once, and each announces its new boot at once: the power loss of a
    whole rack. Answered with how many rebooted."""


@message("rp.sim.sled.freeze")
class SimSledFreeze(SimSledRef):
    pass


@message("rp.sim.sled.thaw")
class SimSledThaw(SimSledRef):
    pass


@message("rp.sim.sled.partition")
class SimSledPartition(SimSledRef):
    """Cut the sled off the network until healed: nothing it sends gets out (reports wait, inventories
    are skipped) and nothing reaches it (its commands wait in the stream). Its VMMs go on running."""


@message("rp.sim.sled.heal")
class SimSledHeal(SimSledRef):
    pass


@message("rp.sim.sled.remove")
class SimSledRemove(SimSledRef):
    pass


@message("rp.sim.sled.add")
class SimSledAdd(Model):
    vcpus: SledVcpus = 64
    ram_bytes: SimSledRam = 256 * 2**30


@message("rp.sim.sled.capacity")
class SimSledCapacity(SimSledRef):
    """The sled reports this capacity from its next inventory on, and sends one at once.

    As a sled that lost cores or DIMMs (or got them back) would: the control plane must cope with a sled
    that holds more than it now says it has. Replaces the last one; a field left null is what the sled
    was made with (both null: restored). Kept across simulator restarts; the simulator enforces none."""

    vcpus: SledVcpus | None = None
    ram_bytes: SledRam | None = None
