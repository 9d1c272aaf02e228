"""Who sends and who receives each kind of message, and on which channel (subject) it travels.

A stream message's receivers are the owners of the durables that read it (durables.py), so a new durable
is a new receiver at once; senders are stated here, once: the contract (shared/contract.py) documents
them, and deploy/identities.py grants the events' senders exactly their events.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from shared.messages import registry
from shared.topology import subjects
from shared.topology.durables import ACCOUNTING, DURABLES, INSTANCE_MANAGER, RECOVERY, SLED_AGENT

OPERATORS = ("rackctl",)
Kind = Literal["request", "stream"]


@dataclass(frozen=True)
class Channel:
    address: str
    """The subject, with `{parameters}` for its variable tokens."""
    kind: Kind
    """`request`: request/reply (the receiver answers on the sender's inbox); `stream`: a JetStream stream."""
    schemas: tuple[str, ...]
    senders: tuple[str, ...]
    receivers: tuple[str, ...]
    description: str
    versions: tuple[int, ...] = (1,)
    """The schema versions that travel here. A request's channel takes every version (the envelope says
    which); an event's later version has a channel, and a subject, of its own (`subjects.event`)."""

    @property
    def parameters(self) -> list[str]:
        return [t[1:-1] for t in self.address.split(".") if t.startswith("{")]


EVENT_SENDERS: dict[str, str] = {
    "rp.evt.silo.created": INSTANCE_MANAGER,
    "rp.evt.project.created": INSTANCE_MANAGER,
    "rp.evt.silo.deleted": INSTANCE_MANAGER,
    "rp.evt.project.deleted": INSTANCE_MANAGER,
    "rp.evt.instance.changed": INSTANCE_MANAGER,
    "rp.evt.pool.changed": INSTANCE_MANAGER,
    "rp.evt.sled.changed": INSTANCE_MANAGER,
    "rp.evt.usage.changed": ACCOUNTING,
    "rp.evt.provision.outcome": ACCOUNTING,
}
"""Each event and the service that publishes it (anyone may follow it; rackplane's own readers are the
durables that read it)."""
FLEET_EVENTS = ("sled",)
"""Resources whose events are the fleet's, on `_fleet`: a sled belongs to no silo."""

ORDERS = (
    "rp.cmd.vmm.lost",
    "rp.cmd.vmm.stuck",
    "rp.cmd.vmm.zombie",
    "rp.cmd.instance.restart",
    "rp.cmd.instance.settle",
)
"""Recovery's orders to instance-manager (conditions: refused as stale when what they saw has moved)."""
FLEET_ONLY = (
    *ORDERS,
    "rp.cmd.silo.create",
    "rp.cmd.silo.delete",
    "rp.cmd.silo.list",
    "rp.cmd.silo.limits",
    "rp.cmd.sled.list",
    "rp.cmd.sled.expunge",
)
"""Commands whose bodies name no silo: they travel on `_fleet` only."""
SERVED_BY_ACCOUNTING = ("usage",)
"""Command resources accounting answers; instance-manager answers every other."""


def readers(schema: str) -> tuple[str, ...]:
    """The services whose durables read messages of `schema`, in the order they are declared."""
    return tuple(dict.fromkeys(d.owner for d in DURABLES if d.schema == schema))


def event_subject(schema: str, silo: str, version: int = 1) -> str:
    """The subject of an event of `schema`: on `silo`, or on `_fleet` for a fleet-wide resource."""
    resource, what = subjects.schema_parts(schema, "evt")
    return subjects.event(None if resource in FLEET_EVENTS else silo, resource, what, version)


def events_sent_by(service: str) -> list[str]:
    """The subjects (every silo's, every version's) of the events `service` publishes."""
    vs = versions()
    return [
        event_subject(schema, "*", v) for schema, sender in EVENT_SENDERS.items() if sender == service
        for v in vs.get(schema, (1,))
    ]  # fmt: skip


def versions() -> dict[str, tuple[int, ...]]:
    """Every registered schema, with its versions in order."""
    out: dict[str, list[int]] = {}
    for schema, version in sorted(registry()):
        out.setdefault(schema, []).append(version)
    return {s: tuple(vs) for s, vs in out.items()}


def channels() -> list[Channel]:
    """Every channel, derived from the registered schemas (so a new schema or version cannot be left out).

    A request carries its version in the envelope and is answered `unsupported_version` by a server that
    does not know it, so every version shares its subject. A stream message is read by consumers that
    filter on subjects: each version of an event has its own, so that a reader of v1 never receives v2."""
    out: list[Channel] = []
    for schema, vs in versions().items():
        ch = replace(_channel(schema), versions=vs)
        if ch.kind == "request":
            out.append(ch)
        elif schema.startswith("rp.evt."):
            out += [
                replace(ch, address=_versioned(ch.address, v), versions=(v,), description=_described(ch, v))
                for v in vs
            ]
        elif vs != (1,):
            raise ValueError(
                f"schema {schema} v{vs[-1]} needs a subject of its own: add it to shared/topology/routes.py"
            )
        else:
            out.append(ch)
    return out


def _versioned(address: str, version: int) -> str:
    return address if version == 1 else f"{address}.v{version}"


def _described(ch: Channel, version: int) -> str:
    return ch.description if version == 1 else f"{ch.description}; version {version}"


def _command(schema: str) -> Channel:
    resource, verb = subjects.schema_parts(schema, "cmd")
    receiver = ACCOUNTING if resource in SERVED_BY_ACCOUNTING else INSTANCE_MANAGER
    sender = (RECOVERY,) if schema in ORDERS else OPERATORS
    return Channel(
        subjects.command(None if schema in FLEET_ONLY else "{silo}", resource, verb),
        "request",
        (schema,),
        sender,
        (receiver,),
        f"{'recovery orders' if schema in ORDERS else 'operator command'}: {resource} {verb}",
    )


def _channel(schema: str) -> Channel:
    """The channel of one schema, at its first version."""
    if schema.startswith("rp.cmd."):
        return _command(schema)
    if schema.startswith("rp.sled.vmm.") and schema != "rp.sled.vmm.report":
        verb = subjects.sled_verb(schema)
        return Channel(
            subjects.sled_command("{sled}", verb),
            "stream",
            (schema,),
            (INSTANCE_MANAGER,),
            (SLED_AGENT,),
            f"a command to one sled: {verb} (stream {subjects.SLED_CMD_STREAM})",
        )
    if schema in ("rp.sled.vmm.report", "rp.sled.inventory"):
        kind = "vmm" if schema == "rp.sled.vmm.report" else "inventory"
        return Channel(
            subjects.sled_report("{sled}", kind),
            "stream",
            (schema,),
            (SLED_AGENT,),
            readers(schema),
            f"a sled's {kind} report (stream {subjects.SLED_REPORT_STREAM})",
        )
    if schema == "rp.acct.delta":
        return Channel(
            subjects.provision_delta("{silo}", "{project}", "{instance}"),
            "stream",
            (schema,),
            (INSTANCE_MANAGER,),
            readers(schema),
            f"a provisioning delta (stream {subjects.PROVISION_STREAM}, by partition of instance)",
        )
    if schema.startswith("rp.evt."):
        resource, what = subjects.schema_parts(schema, "evt")
        return Channel(
            event_subject(schema, "{silo}"),
            "stream",
            (schema,),
            (EVENT_SENDERS[schema],),
            readers(schema),
            f"event: {resource} {what} (stream {subjects.EVENTS_STREAM}; anyone may follow it)",
        )
    if schema.startswith("rp.sim."):
        return Channel(schema, "request", (schema,), OPERATORS, (SLED_AGENT,), "simulator control")
    if schema.startswith("rp.svc."):
        what = schema.removeprefix("rp.svc.")
        return Channel(
            subjects.service_control("{service}", what),
            "request",
            (schema,),
            OPERATORS,
            subjects.SERVICES,
            f"a service's {what}",
        )
    raise ValueError(f"schema {schema} has no channel: add it to shared/topology/routes.py")
