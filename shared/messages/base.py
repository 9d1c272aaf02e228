"""What every message shares: the envelope, the registry of versioned schemas, encode and decode, and the
field types that bound what a message may carry.

Every message on the bus is an `Envelope` whose `data` validates against the model registered for its
`(schema, version)`. A message that fails this never reaches a handler: the bus layer answers it with an
error reply (commands) or dead-letters it with the reason (streams).

What arrives is read strictly (pydantic strict mode, in JSON mode): an integer must be a JSON integer,
not "2", true or 2.0, and a boolean a JSON boolean, so that a sender never has its mistake guessed into
a value; UUIDs and times, which JSON has no type for, are strings in their format. And no string of any
message may hold what PostgreSQL cannot store (NUL): refused here, where it enters, naming the field,
rather than failing as an `internal` error at the first query that carries it.

Every limit lives here, and only here, so that the domain modules say what a message holds and this one
how large any of it may be.
"""

from __future__ import annotations

import re
import uuid
from collections import abc
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from enum import Enum
from functools import cache
from types import UnionType
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
)
from pydantic_core import to_json
from typing_extensions import TypedDict

# --- names --------------------------------------------------------------------------------------------

NAME_PATTERN = r"^[a-z][a-z0-9-]{0,62}$"
"""Silo, project, instance and pool names: safe as NATS subject tokens and as path segments."""

Name = Annotated[str, Field(pattern=NAME_PATTERN)]

PoolName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,55}$")]
"""Shorter than other names: the pool's VMs are named `<pool>-<6 hex digits>` until handed out."""

# --- amounts ------------------------------------------------------------------------------------------
# Every amount a message carries is bounded here, so that no total can overflow a bigint: the largest
# charge is far below MAX_TOTAL, and accounting refuses a charge that would take the fleet's total past
# MAX_TOTAL (half of the bigint range, so that concurrent charges cannot overshoot it).

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

Vcpus = InstanceVcpus
"""The shape an operator asks for (an instance, a pool's VMs): vCPUs as a VMM may have them, and at least
1 MiB of RAM and of disk."""
RamBytes = Annotated[int, Field(ge=2**20, le=MAX_INSTANCE_RAM_BYTES)]
DiskBytes = Annotated[int, Field(ge=2**20, le=MAX_DISK_BYTES)]

SimSledRam = Annotated[int, Field(ge=2**30, le=MAX_SLED_RAM_BYTES)]
"""A simulated sled added at run time has at least 1 GiB of RAM."""

# --- counters -----------------------------------------------------------------------------------------

Generation = Annotated[int, Field(ge=1, le=2**62)]
BootNumber = Annotated[int, Field(ge=1, le=2**62)]
"""A sled's boot counter: it only grows, by one at every reboot, and survives restarts of the agent."""
Sequence = Annotated[int, Field(ge=0, le=2**62)]
"""A sled's message counter within one boot: (boot number, sequence) orders everything a sled says."""

# --- lists and pools ----------------------------------------------------------------------------------

PAGE_LIMIT = 500
"""The most rows one list reply carries: far below the broker's max_payload even for the widest rows."""

PageSize = Annotated[int, Field(ge=1, le=PAGE_LIMIT)]
Cursor = Annotated[str, Field(min_length=1, max_length=300)]
PoolSize = Annotated[int, Field(ge=0, le=1000)]
LimitCount = Annotated[int, Field(ge=0, le=10_000_000)]
"""A silo's tenant limit on how many projects, instances or pool members it may hold."""
CommandRate = Annotated[int, Field(ge=1, le=1_000_000)]
"""A silo's command rate limit, commands a second."""

# --- usage history ------------------------------------------------------------------------------------

MIN_HISTORY_SECONDS = 60
MAX_HISTORY_SECONDS = 90 * 86400
MAX_HISTORY_BUCKETS = 500
"""The most intervals a usage history reply carries: some 250 bytes each, far below max_payload."""

HistorySeconds = Annotated[int, Field(ge=MIN_HISTORY_SECONDS, le=MAX_HISTORY_SECONDS)]
HistoryBuckets = Annotated[int, Field(ge=1, le=MAX_HISTORY_BUCKETS)]

# --- fault injection and the simulator ----------------------------------------------------------------

MAX_HOLD_SECONDS = 5
"""How long a fault may hold a message: the outbox relay gives up on a batch not acked within 10 s."""

HoldSeconds = Annotated[float, Field(ge=0, le=MAX_HOLD_SECONDS)]
ReorderHoldSeconds = Annotated[float, Field(gt=0, le=MAX_HOLD_SECONDS)]
ReorderWindow = Annotated[int, Field(ge=0, le=1000)]
HeldAcks = Annotated[int, Field(ge=0, le=1_000_000)]
HandlerDelaySeconds = Annotated[float, Field(ge=0, le=600)]
SubjectPrefix = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\s]+$")]
SubjectPrefixes = Annotated[list[SubjectPrefix], Field(max_length=20)]
Copies = Annotated[int, Field(ge=0, le=10)]
"""How many extra copies of each message a fault sends (a service's, or a simulated sled's)."""
Probability = Annotated[float, Field(ge=0, le=1)]
ReportDelaySeconds = Annotated[float, Field(ge=0, le=3600)]
ReportDelayCount = Annotated[int, Field(ge=0, le=1000)]
"""How long, and for how many reports, a simulated sled holds its reports back."""

# --- a rule several domains share ---------------------------------------------------------------------


def project_within_silo(cls: type, v: str | None, info: ValidationInfo) -> str | None:
    """A project is named within a silo: a body naming a project names its silo too."""
    if v is not None and info.data.get("silo") is None:
        raise ValueError("a project is named within a silo")
    return v


# --- models, the envelope and the registry ------------------------------------------------------------


class BadMessage(Exception):
    """A message that cannot be handled as sent: unparseable, unknown schema or version, invalid data."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
"""What no text column can hold: NUL (PostgreSQL's text refuses it), and lone surrogates (not UTF-8)."""


def storable(value: Any) -> Any:
    """`value`, if every string in it (nested, and a dictionary's keys) is one PostgreSQL can store."""
    if isinstance(value, str):
        if found := UNSTORABLE.search(value):
            raise ValueError(f"holds U+{ord(found.group()):04X} at {found.start()}, which no string may")
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            storable(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            storable(key)
            storable(item)
    return value


class Model(BaseModel):
    """Commands, reports and deltas are read strictly: a field the reader does not know is an error.

    Every string field of every message (this class's and `Event`'s subclasses, the envelope too) passes
    `storable`: one rule here, rather than one per field or command, so that a field added tomorrow is
    covered too. A nested model checks its own fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*")
    @classmethod
    def _storable(cls, value: Any) -> Any:
        return storable(value)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """`_storable` on the fields that can hold a string, not on every field: a call per field and
        message was most of what reading a provisioning delta (UUIDs and integers only) cost
        (docs/benchmarks.md). Decided on each class's resolved fields, its inherited ones too."""
        super().__pydantic_init_subclass__(**kwargs)
        found = cls.__pydantic_decorators__.field_validators.get("_storable")
        if found is None or _function(found.func) is not _function(Model._storable):
            return  # a class with a rule of its own (the envelope)
        fields: tuple[str, ...] = ("*",)  # what a parent narrowed to its fields is widened again first
        if cls.__pydantic_complete__:  # otherwise its fields are not resolved yet: all are checked
            text = tuple(name for name, f in cls.model_fields.items() if may_hold_text(f.annotation))
            fields = fields if len(text) == len(cls.model_fields) else text
        if found.info.fields != fields:
            cls.__pydantic_decorators__.field_validators["_storable"] = replace(
                found, info=replace(found.info, fields=fields, check_fields=False)
            )
            if cls.__pydantic_complete__:
                cls.model_rebuild(force=True)


def _function(f: Any) -> Any:
    return getattr(f, "__func__", f)


def may_hold_text(annotation: Any) -> bool:
    """Whether a value of this type can hold a string anywhere (a dictionary's keys too): anything but
    numbers, booleans, UUIDs, times, non-string enums and models (which check their own fields)."""
    if annotation is None or annotation is type(None):
        return False
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return False
        if issubclass(annotation, str):
            return True
        if issubclass(annotation, bool | int | float | uuid.UUID | datetime) or (
            issubclass(annotation, Enum) and not issubclass(annotation, str)
        ):
            return False
    args = get_args(annotation)
    origin = get_origin(annotation)
    if origin is Annotated:
        return may_hold_text(args[0])
    if origin is Literal:
        return any(isinstance(a, str) for a in args)
    if args and origin in (Union, UnionType, list, tuple, set, frozenset, dict, abc.Sequence, abc.Mapping):
        return any(may_hold_text(a) for a in args if a is not Ellipsis)
    return True  # Any, a bare container, or a type not known here: checked


class Event(Model):
    """Events (and the views they carry) are read tolerantly: a field the reader does not know is ignored,
    so that adding an optional field keeps the version (docs/subjects.md, "Versions")."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class Envelope(Model):
    """What every message is: its schema and version, id, sender and time, and its body (`data`), a dict
    as `decode` reads it, the body's model itself as `decode_one` does."""

    schema_: str = Field(alias="schema", min_length=1, max_length=100)
    version: int = Field(ge=1)
    id: uuid.UUID
    source: str = Field(min_length=1, max_length=200)
    time: datetime
    data: dict[str, Any]

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("schema_", "source")
    @classmethod
    def _storable(cls, value: Any) -> Any:
        """The envelope's own strings; `data` is the body's model's to check, so that a NUL in the body is
        `invalid` and names its field (this replaces `Model._storable`, which would check it here)."""
        return storable(value)


class ReplyError(TypedDict):
    """Why a request was refused: `code`, one word a program can branch on (docs/subjects.md lists them),
    and `message`, one line for a person. A dict, so that callers read it as they always have."""

    code: str
    message: str


class Reply(BaseModel):
    """The body of every request/reply answer: `ok` with `data`, or an error with a code and message."""

    ok: bool = Field(description="whether the request was carried out")
    data: Any = Field(None, description="the answer when `ok`: its shape is the command's (docs/subjects.md)")
    error: ReplyError | None = Field(None, description="why not, when not `ok`")


_REGISTRY: dict[tuple[str, int], type[Model]] = {}
_SCHEMA_OF: dict[type[Model], tuple[str, int]] = {}

_ModelT = TypeVar("_ModelT", bound=Model)


def message(schema: str, version: int = 1) -> Callable[[type[_ModelT]], type[_ModelT]]:
    """Register a model as the body of `schema` at `version`."""

    def register(cls: type[_ModelT]) -> type[_ModelT]:
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


def encode_envelope(body: Model, source: str, msg_id: uuid.UUID) -> bytes:
    """`encode(envelope(body, source, msg_id))`, the same bytes, without building and validating the
    envelope: its parts are the registry's, the caller's constant and an id, and the body is a validated
    model already. A third of the cost, for the outbox's thousand events a batch (docs/benchmarks.md)."""
    schema, version = schema_of(body)
    return to_json(
        {
            "schema": schema,
            "version": version,
            "id": msg_id,
            "source": source,
            "time": datetime.now(UTC),
            "data": body,
        },
        by_alias=False,
    )


def decode(raw: bytes, expect: type[Model] | tuple[type[Model], ...] | None = None) -> tuple[Envelope, Model]:
    """Parse and validate raw bytes into (envelope, body); raise BadMessage with a reason otherwise."""
    try:
        env = Envelope.model_validate_json(raw, strict=True)
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
            served = sorted(_SCHEMA_OF[m][1] for m in allowed if _SCHEMA_OF[m][0] == env.schema_)
            if served:  # the schema, at a version this reader does not take
                raise BadMessage(
                    "unsupported_version",
                    f"schema {env.schema_} version {env.version} is not supported here (supported: {served})",
                )
            names = ", ".join(_SCHEMA_OF[m][0] for m in allowed)
            raise BadMessage("wrong_schema", f"expected {names}, got {env.schema_}")
    try:
        body = read_body(model, env.data)
    except ValidationError as e:
        raise BadMessage("invalid", f"{env.schema_} v{env.version}: {_first_error(e)}") from None
    return env, body


def decode_one(raw: bytes, model: type[_ModelT]) -> tuple[Envelope, _ModelT]:
    """`decode(raw, model)` for a reader of one model (a stream's consumer), in one pass: the envelope and
    its body read together, a third faster than reading the envelope and then its body again from a dict
    (docs/benchmarks.md). The envelope's `data` is then the body itself, not a dict (a reader that needs
    the dict, as a command's digest does, uses `decode`). A message that is not `model`'s, or not valid,
    is read the general way, which says what is wrong with it."""
    try:
        env = _enveloped(model).model_validate_json(raw, strict=True)
    except ValidationError:
        return decode(raw, model)  # type: ignore[return-value]
    if (env.schema_, env.version) != _SCHEMA_OF[model]:
        return decode(raw, model)  # type: ignore[return-value]
    return env, env.data


@cache
def _enveloped(model: type[Model]) -> type[Envelope]:
    """An `Envelope` whose `data` is read as `model`: the same fields and checks, the body's by its own
    model, as `read_body` reads it (strict, in JSON mode)."""
    return create_model(f"{model.__name__}Envelope", __base__=Envelope, data=(model, ...))


def read_body(model: type[_ModelT], data: Any) -> _ModelT:
    """`data`, a body as JSON carried it, read by `model` strictly and in JSON mode: strict python mode
    would refuse a UUID or a time given as a string, the only way JSON can give them. (Written back to
    JSON by pydantic-core, as fast as a lax read of the dict; NaN and infinities kept as they came.)"""
    return model.model_validate_json(to_json(data, inf_nan_mode="constants"), strict=True)


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "message"
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{where}: {err['msg']}{more}"
