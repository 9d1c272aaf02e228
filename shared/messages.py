"""Versioned message schemas and the envelope that carries every one of them.

Every message on the bus is an `Envelope` whose `data` validates against the model registered for its
`(schema, version)`. A message that fails this never reaches a handler: the bus layer answers it with an
error reply (commands) or dead-letters it with the reason (streams).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

NAME_PATTERN = r"^[a-z][a-z0-9-]{0,62}$"
"""Silo, project, instance and pool names: safe as NATS subject tokens and as path segments."""

Name = Annotated[str, Field(pattern=NAME_PATTERN)]

# Limits: every amount a message carries is bounded here, and only here, so that no total can overflow a
# bigint: the largest charge is far below MAX_TOTAL, and accounting refuses a charge that would take the
# fleet's total past MAX_TOTAL (half of the bigint range, so that concurrent charges cannot overshoot it).
MAX_INSTANCE_VCPUS = 256
MAX_INSTANCE_RAM_BYTES = 2**44  # 16 TiB
MAX_DISK_BYTES = 2**46  # 64 TiB
MAX_SLED_VCPUS = 4096
MAX_SLED_RAM_BYTES = 2**46  # 64 TiB
MAX_TOTAL = 2**62
"""The most a total (fleet, silo, project) or a quota may hold."""

InstanceVcpus = Annotated[int, Field(ge=1, le=MAX_INSTANCE_VCPUS)]
InstanceRam = Annotated[int, Field(ge=1, le=MAX_INSTANCE_RAM_BYTES)]
SledVcpus = Annotated[int, Field(ge=1, le=MAX_SLED_VCPUS)]
SledRam = Annotated[int, Field(ge=1, le=MAX_SLED_RAM_BYTES)]
ChargedVcpus = Annotated[int, Field(ge=0, le=MAX_INSTANCE_VCPUS)]
ChargedRam = Annotated[int, Field(ge=0, le=MAX_INSTANCE_RAM_BYTES)]
ChargedDisk = Annotated[int, Field(ge=0, le=MAX_DISK_BYTES)]
QuotaAmount = Annotated[int, Field(ge=0, le=MAX_TOTAL)]
Generation = Annotated[int, Field(ge=1, le=2**62)]
BootNumber = Annotated[int, Field(ge=1, le=2**62)]
"""A sled's boot counter: it only grows, by one at every reboot, and survives restarts of the agent."""
Sequence = Annotated[int, Field(ge=0, le=2**62)]
"""A sled's message counter within one boot: (boot number, sequence) orders everything a sled says."""


def project_within_silo(cls: type, v: str | None, info: Any) -> str | None:
    """A project is named within a silo: a body naming a project names its silo too."""
    if v is not None and info.data.get("silo") is None:
        raise ValueError("a project is named within a silo")
    return v


class BadMessage(Exception):
    """A message that cannot be handled as sent: unparseable, unknown schema or version, invalid data."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Model(BaseModel):
    """Commands, reports and deltas are read strictly: a field the reader does not know is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Event(Model):
    """Events (and the views they carry) are read tolerantly: a field the reader does not know is ignored,
    so that adding an optional field keeps the version (docs/subjects.md, "Versions")."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class Envelope(Model):
    schema_: str = Field(alias="schema", min_length=1, max_length=100)
    version: int = Field(ge=1)
    id: uuid.UUID
    source: str = Field(min_length=1, max_length=200)
    time: datetime
    data: dict[str, Any]

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


_REGISTRY: dict[tuple[str, int], type[Model]] = {}
_SCHEMA_OF: dict[type[Model], tuple[str, int]] = {}


def message(schema: str, version: int = 1):
    """Register a model as the body of `schema` at `version`."""

    def register(cls: type[Model]) -> type[Model]:
        key = (schema, version)
        if key in _REGISTRY:
            raise RuntimeError(f"schema {schema} v{version} registered twice")
        _REGISTRY[key] = cls
        _SCHEMA_OF[cls] = key
        return cls

    return register


def schema_of(model: type[Model] | Model) -> tuple[str, int]:
    cls = model if isinstance(model, type) else type(model)
    return _SCHEMA_OF[cls]


def registry() -> dict[tuple[str, int], type[Model]]:
    return dict(_REGISTRY)


def envelope(body: Model, source: str, msg_id: uuid.UUID | None = None) -> Envelope:
    schema, version = schema_of(body)
    return Envelope(
        schema=schema,
        version=version,
        id=msg_id or uuid.uuid4(),
        source=source,
        time=datetime.now(UTC),
        data=body.model_dump(mode="json"),
    )


def encode(env: Envelope) -> bytes:
    return env.model_dump_json(by_alias=True).encode()


def decode(raw: bytes, expect: type[Model] | tuple[type[Model], ...] | None = None) -> tuple[Envelope, Model]:
    """Parse and validate raw bytes into (envelope, body); raise BadMessage with a reason otherwise."""
    try:
        env = Envelope.model_validate_json(raw)
    except ValidationError as e:
        raise BadMessage("malformed", f"not a valid envelope: {_first_error(e)}") from None
    model = _REGISTRY.get((env.schema_, env.version))
    if model is None:
        known = sorted(v for (s, v) in _REGISTRY if s == env.schema_)
        if known:
            raise BadMessage(
                "unsupported_version",
                f"schema {env.schema_} version {env.version} is not supported (supported: {known})",
            )
        raise BadMessage("unknown_schema", f"unknown schema {env.schema_!r}")
    if expect is not None:
        allowed = expect if isinstance(expect, tuple) else (expect,)
        if model not in allowed:
            names = ", ".join(_SCHEMA_OF[m][0] for m in allowed)
            raise BadMessage("wrong_schema", f"expected {names}, got {env.schema_}")
    try:
        body = model.model_validate(env.data)
    except ValidationError as e:
        raise BadMessage("invalid", f"{env.schema_} v{env.version}: {_first_error(e)}") from None
    return env, body


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "message"
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{where}: {err['msg']}{more}"


# --- domain vocabulary ---------------------------------------------------------------------------------


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


class AutoRestart(StrEnum):
    best_effort = "best_effort"
    never = "never"


# --- commands to sleds (JetStream, rp.sled.<sled>.cmd.*) -----------------------------------------------


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


# --- reports from sleds (JetStream, rp.sled.<sled>.report.*) --------------------------------------------


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


# --- accounting (JetStream, rp.acct.delta.<silo>.<project>) ---------------------------------------------


@message("rp.acct.delta")
class ProvisionDelta(Model):
    """What one instance should be charged, as of its state generation.

    It states the whole charge rather than a difference, so that applying it twice, or after a newer one,
    is detectable from the generation alone.
    """

    instance_id: uuid.UUID
    project_id: uuid.UUID
    silo_id: uuid.UUID
    generation: Generation
    vcpus: ChargedVcpus
    ram_bytes: ChargedRam
    disk_bytes: ChargedDisk


class Outcome(StrEnum):
    applied = "applied"
    refused = "refused"
    stale = "stale"


@message("rp.evt.provision.outcome")
class ProvisionOutcome(Event):
    instance_id: uuid.UUID
    generation: Generation
    outcome: Outcome
    reason: str = ""


class Usage(Event):
    vcpus: int
    ram_bytes: int
    disk_bytes: int


@message("rp.evt.usage.changed")
class UsageChanged(Event):
    silo_id: uuid.UUID
    project_id: uuid.UUID
    project: Usage
    silo: Usage


# --- events (JetStream, rp.evt.<silo>.*) ---------------------------------------------------------------


class Quota(Model):
    vcpus: QuotaAmount | None = None
    ram_bytes: QuotaAmount | None = None
    disk_bytes: QuotaAmount | None = None


@message("rp.evt.silo.created")
class SiloCreated(Event):
    silo_id: uuid.UUID
    name: Name
    quota: Quota


@message("rp.evt.project.created")
class ProjectCreated(Event):
    project_id: uuid.UUID
    silo_id: uuid.UUID
    silo: Name
    name: Name


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
    """`unknown`: its sled has gone quiet. Such an instance is neither failed nor restarted."""
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


# --- operator commands (request/reply, rp.cmd.<silo>.<resource>.<verb>) -------------------------------

PAGE_LIMIT = 500
"""The most rows one list reply carries: far below the broker's max_payload even for the widest rows."""


class Paged(Model):
    """A list is read a page at a time, in a stable order: `after` is the `next` of the page before (an
    opaque cursor); the reply is `{items, next}`, `next` null on the last page."""

    limit: Annotated[int, Field(ge=1, le=PAGE_LIMIT)] = 100
    after: Annotated[str, Field(min_length=1, max_length=300)] | None = None


@message("rp.cmd.silo.create")
class SiloCreate(Model):
    name: Name
    quota: Quota = Quota()


@message("rp.cmd.silo.list")
class SiloList(Paged):
    pass


@message("rp.cmd.project.create")
class ProjectCreate(Model):
    silo: Name
    name: Name


@message("rp.cmd.project.list")
class ProjectList(Paged):
    silo: Name


class InstanceRef(Model):
    silo: Name
    project: Name
    name: Name


Vcpus = Annotated[int, Field(ge=1, le=MAX_INSTANCE_VCPUS)]
RamBytes = Annotated[int, Field(ge=2**20, le=MAX_INSTANCE_RAM_BYTES)]
DiskBytes = Annotated[int, Field(ge=2**20, le=MAX_DISK_BYTES)]


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


@message("rp.cmd.sled.list")
class SledList(Paged):
    pass


# --- warm pools (request/reply, rp.cmd.<silo>.pool.<verb>) ----------------------------------------------

PoolName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,55}$")]
"""Shorter than other names: the pool's VMs are named `<pool>-<6 hex digits>` until handed out."""


class PoolRef(Model):
    silo: Name
    project: Name
    name: PoolName


@message("rp.cmd.pool.create")
class PoolCreate(PoolRef):
    size: Annotated[int, Field(ge=0, le=1000)]
    vcpus: Vcpus
    ram_bytes: RamBytes
    disk_bytes: DiskBytes


@message("rp.cmd.pool.show")
class PoolShow(PoolRef):
    pass


@message("rp.cmd.pool.resize")
class PoolResize(PoolRef):
    size: Annotated[int, Field(ge=0, le=1000)]


@message("rp.cmd.pool.delete")
class PoolDelete(PoolRef):
    pass


@message("rp.cmd.pool.list")
class PoolList(Paged):
    silo: Name | None = None
    project: Name | None = None

    _project_needs_silo = field_validator("project")(project_within_silo)


class PoolView(Event):
    id: uuid.UUID
    silo: Name
    project: Name
    silo_id: uuid.UUID
    project_id: uuid.UUID
    name: str
    vcpus: int
    ram_bytes: int
    disk_bytes: int
    target_size: int
    state: Literal["active", "deleted"]
    generation: int
    idle: int
    provisioning: int
    handed_out: int


@message("rp.evt.pool.changed")
class PoolChanged(Event):
    """A pool was created, resized, deleted, or handed one of its VMs out (`instance_id`)."""

    pool: PoolView
    change: Literal["created", "resized", "deleted", "picked"]
    instance_id: uuid.UUID | None = None


@message("rp.cmd.sled.expunge")
class SledExpunge(Model):
    """The sled is gone for good: never placed on again; its instances fail (and restart by policy)."""

    sled_id: Name


# --- recovery's orders to instance-manager (request/reply, fleet subjects) ----------------------------
# An order is a condition: each names what recovery saw, and instance-manager applies it only if all of
# that still holds under its own row locks; otherwise it answers `stale` and changes nothing.


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


@message("rp.cmd.usage.get")
class UsageGet(Model):
    silo: Name | None = None
    project: Name | None = None

    _project_needs_silo = field_validator("project")(project_within_silo)


# --- simulator control (request/reply, rp.sim.*) ---------------------------------------------------------


@message("rp.sim.faults.set")
class SimFaults(Model):
    """Faults a simulated sled applies to its own outgoing reports, until changed."""

    sled_id: Name
    delay_state: VmmState | None = None
    delay_seconds: Annotated[float, Field(ge=0, le=3600)] = 0
    delay_count: Annotated[int, Field(ge=0, le=1000)] = 0
    duplicate: Annotated[int, Field(ge=0, le=10)] = 0
    drop_probability: Annotated[float, Field(ge=0, le=1)] = 0
    drop_commands: bool = False
    """Take commands off the stream but do nothing with them: a sled that never answers a start or stop."""
    fail_starts: bool = False
    """Every VMM that boots fails at once instead of running: a crash loop."""


@message("rp.sim.sled.list")
class SimSledList(Model):
    pass


class SimSledRef(Model):
    sled_id: Name


@message("rp.sim.sled.reboot")
class SimSledReboot(SimSledRef):
    pass


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
    vcpus: Annotated[int, Field(ge=1, le=MAX_SLED_VCPUS)] = 64
    ram_bytes: Annotated[int, Field(ge=2**30, le=MAX_SLED_RAM_BYTES)] = 256 * 2**30


class Reply(BaseModel):
    """The body of every request/reply answer: `ok` with `data`, or an error with a code and message."""

    ok: bool
    data: Any = None
    error: dict[str, str] | None = None


@message("rp.svc.stats")
class StatsGet(Model):
    """Ask a service for its counters (fences fired, duplicates seen, dead letters...)."""


# --- fault injection (request/reply, rp.svc.<service>.faults) -------------------------------------------

HoldSeconds = Annotated[float, Field(ge=0, le=5)]
"""How long a fault may hold a message: the outbox relay gives up on a batch not acked within 10 s."""
SubjectPrefix = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\s]+$")]


class DelayFault(Model):
    """Hold each outgoing message for a time drawn uniformly from [min_seconds, max_seconds]."""

    min_seconds: HoldSeconds
    max_seconds: HoldSeconds

    @model_validator(mode="after")
    def _ordered(self) -> DelayFault:
        if self.max_seconds < self.min_seconds:
            raise ValueError("max_seconds must not be below min_seconds")
        return self


class DuplicateFault(Model):
    """Send each outgoing message `copies` more times, the k-th copy `copy_delay_seconds` x k later."""

    copies: Annotated[int, Field(ge=0, le=10)]
    bypass_dedupe: bool = False
    """Give each copy its own Nats-Msg-Id, so that the broker keeps it and the consumers must drop it."""
    copy_delay_seconds: HoldSeconds = 0.05


class ReorderFault(Model):
    """Hold outgoing messages until `window` are held (or the oldest waited `max_hold_seconds`), then
    release them shuffled. A window of 0 turns it off."""

    window: Annotated[int, Field(ge=0, le=1000)]
    max_hold_seconds: Annotated[float, Field(gt=0, le=5)] = 0.5


class HoldAcksFault(Model):
    """Do not ack a handled message (so JetStream redelivers it after ack_wait): the next `count` ones,
    then each with `probability`."""

    probability: Annotated[float, Field(ge=0, le=1)] = 0
    count: Annotated[int, Field(ge=0, le=1_000_000)] = 0


class RequestFault(Model):
    """Faults on the requests (commands) a service answers: each is handled twice with
    `duplicate_probability` (a request its sender retried), its reply held for up to
    `delay_reply_seconds`, or dropped with `drop_reply_probability` (the requester times out, and may ask
    again)."""

    duplicate_probability: Annotated[float, Field(ge=0, le=1)] = 0
    delay_reply_seconds: HoldSeconds = 0
    drop_reply_probability: Annotated[float, Field(ge=0, le=1)] = 0


@message("rp.svc.faults")
class ServiceFaults(Model):
    """Set or read the faults a service injects into its own messages (shared/faults.py).

    A field left null keeps its current setting, so a body with no field only reads them; `clear` first
    removes every fault and the subject filter. A fault is turned off by its zero value.
    """

    clear: bool = False
    delay: DelayFault | None = None
    duplicate: DuplicateFault | None = None
    reorder: ReorderFault | None = None
    drop_first_attempt: bool | None = None
    """Fail the first publish of each message (same subject and content), so that the sender's retry is
    what arrives."""
    hold_acks: HoldAcksFault | None = None
    slow_handler_seconds: Annotated[float, Field(ge=0, le=600)] | None = None
    """Sleep this long before handling a message's first delivery, handled concurrently with the rest."""
    requests: RequestFault | None = None
    """Faults on the requests the service answers (not on its stats and faults subjects)."""
    only: Annotated[list[SubjectPrefix], Field(max_length=20)] | None = None
    """Apply the faults only to subjects starting with one of these prefixes; empty: every subject."""
    seed: int | None = None
    """Seed the fault layer's random choices (delays, probabilities, shuffles), for a repeatable run."""
    skip_order_fence: bool | None = None
    """instance-manager applies recovery's orders without checking what they saw: a deliberate bug, so
    that a test can show the checker catching the wrongful kills it causes."""
