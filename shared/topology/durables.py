"""Every durable consumer as data: its name, its stream, its filter and the service that owns it.

The services create and read their durables from these records, deploy/identities.py grants each owner
exactly its own, and the checker expects each on the broker: a durable named anywhere else could drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.topology.subjects import (
    DELTA_DEAD_LETTERS,
    DELTA_PARTITIONS,
    EVENTS_STREAM,
    PROVISION_STREAM,
    SLED_CMD_STREAM,
    SLED_REPORT_STREAM,
    dead_letter,
    delta_durable,
    delta_partition,
    event,
    sled_command,
    sled_durable,
    sled_report,
)

INSTANCE_MANAGER = "instance-manager"
ACCOUNTING = "accounting"
RECOVERY = "recovery"
SLED_AGENT = "sled-agent"


@dataclass(frozen=True)
class Durable:
    """One durable consumer: what it reads (`filter_subject` on `stream`), for whom (`owner`, the service
    that names itself so), and what it reads there (`schema`)."""

    name: str
    stream: str
    filter_subject: str
    owner: str
    schema: str
    max_deliver: int | None = None
    """Deliveries before the message is dead-lettered, where not the consumer's default."""
    dead_letters: str | None = None
    """The name its dead letters are filed under (`rp.dlq.<owner>.<name>`), where not its own: the
    partitions of one stream share one."""

    @property
    def files_under(self) -> str:
        return self.dead_letters or self.name

    @property
    def dead_letter_subject(self) -> str:
        """Where it files the messages it gives up on."""
        return dead_letter(self.owner, self.files_under)

    @property
    def binding(self) -> dict[str, Any]:
        """What a consumer of it is made with: `bus.Consumer(js, **durable.binding, ...)`."""
        out: dict[str, Any] = {
            "stream": self.stream,
            "durable": self.name,
            "filter_subject": self.filter_subject,
        }
        if self.max_deliver is not None:
            out["max_deliver"] = self.max_deliver
        if self.dead_letters is not None:
            out["dead_letters"] = self.dead_letters
        return out


IM_VMM_REPORTS = Durable(
    "instance-manager-vmm-reports", SLED_REPORT_STREAM, sled_report("*", "vmm"), INSTANCE_MANAGER,
    "rp.sled.vmm.report",
)  # fmt: skip
IM_INVENTORY = Durable(
    "instance-manager-inventory", SLED_REPORT_STREAM, sled_report("*", "inventory"), INSTANCE_MANAGER,
    "rp.sled.inventory",
)  # fmt: skip
IM_OUTCOMES = Durable(
    "instance-manager-outcomes", EVENTS_STREAM, event("*", "provision", "outcome"), INSTANCE_MANAGER,
    "rp.evt.provision.outcome",
)  # fmt: skip
ACCOUNTING_DELTAS = tuple(
    Durable(
        delta_durable(p),
        PROVISION_STREAM,
        delta_partition(p),
        ACCOUNTING,
        "rp.acct.delta",
        dead_letters=DELTA_DEAD_LETTERS,
    )
    for p in range(DELTA_PARTITIONS)
)
"""One per partition of the stored deltas, applied side by side."""
ACCOUNTING_SILOS = Durable(
    "accounting-silos", EVENTS_STREAM, event("*", "silo", "created"), ACCOUNTING, "rp.evt.silo.created"
)
ACCOUNTING_PROJECTS = Durable(
    "accounting-projects", EVENTS_STREAM, event("*", "project", "created"), ACCOUNTING,
    "rp.evt.project.created",
)  # fmt: skip
RECOVERY_INSTANCES = Durable(
    "recovery-instances", EVENTS_STREAM, event("*", "instance", "changed"), RECOVERY,
    "rp.evt.instance.changed",
)  # fmt: skip
RECOVERY_INSTANCES_V2 = Durable(
    "recovery-instances-v2", EVENTS_STREAM, event("*", "instance", "changed", version=2), RECOVERY,
    "rp.evt.instance.changed",
)  # fmt: skip
RECOVERY_INVENTORY = Durable(
    "recovery-inventory", SLED_REPORT_STREAM, sled_report("*", "inventory"), RECOVERY, "rp.sled.inventory"
)
RECOVERY_SLEDS = Durable(
    "recovery-sleds", EVENTS_STREAM, event(None, "sled", "changed"), RECOVERY, "rp.evt.sled.changed"
)

DURABLES: tuple[Durable, ...] = (
    IM_VMM_REPORTS,
    IM_INVENTORY,
    IM_OUTCOMES,
    *ACCOUNTING_DELTAS,
    ACCOUNTING_SILOS,
    ACCOUNTING_PROJECTS,
    RECOVERY_INSTANCES,
    RECOVERY_INSTANCES_V2,
    RECOVERY_INVENTORY,
    RECOVERY_SLEDS,
)
"""The services' fixed durables, each owner's in the order it declares them (the sleds' own come and go
with the sleds: `sled`)."""

SLED_MAX_DELIVER = 1_000_000
"""A frozen sled holds its commands back for as long as it stays frozen: its orders are never given up."""


def sled(sled_id: str) -> Durable:
    """The durable through which one sled reads its orders: only its own subject."""
    return Durable(
        sled_durable(sled_id), SLED_CMD_STREAM, sled_command(sled_id, ">"), SLED_AGENT, "rp.sled.vmm",
        SLED_MAX_DELIVER,
    )  # fmt: skip


def owned_by(owner: str) -> tuple[Durable, ...]:
    """The fixed durables of one service, in the order it declares them."""
    return tuple(d for d in DURABLES if d.owner == owner)


def on_stream(stream: str) -> tuple[Durable, ...]:
    """The fixed durables on one stream."""
    return tuple(d for d in DURABLES if d.stream == stream)


def named(name: str) -> Durable:
    """The fixed durable of that name."""
    for d in DURABLES:
        if d.name == name:
            return d
    raise KeyError(f"no durable {name!r}")
