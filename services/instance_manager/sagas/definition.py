"""What a saga is: a named list of steps with their undos, typed parameters (`Params`), and each step's
output a typed model (`Output`) that the steps after it read back (`Context.get`). How one is run, durably
and under a lease, is engine.py's."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import asyncpg
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from services.instance_manager.app import App


class Status(StrEnum):
    """A saga's status (stored), or why `launch` could not drive it here."""

    running = "running"
    unwinding = "unwinding"
    done = "done"
    failed = "failed"
    busy = "busy"
    """Another process holds its lease, or it is over."""
    lost = "lost"
    """Another process took its lease while this one ran it: it goes on there."""
    missing = "missing"

    @property
    def over(self) -> bool:
        return self in (Status.done, Status.failed)


class LeaseLost(Exception):
    """Another process took the saga's lease (this one's had expired): this one stops running it."""


class StepFailed(Exception):
    """The step cannot succeed: the saga unwinds, and `reason` becomes its error."""

    def __init__(self, reason: str, step: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.step = step
        """The step that failed, when it is not the one at the saga's cursor (local steps run together)."""


class Params(BaseModel):
    """A saga's parameters, as given to `begin` and stored with it. Keys it does not know are ignored,
    so that a saga begun by an older version resumes."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class Output(BaseModel):
    """What a step hands to the steps after it: read back from the saga's data by `Context.get`."""

    model_config = ConfigDict(frozen=True, extra="ignore")


ParamsT = TypeVar("ParamsT", bound=Params)
OutputT = TypeVar("OutputT", bound=Output)


@dataclass
class Context(Generic[ParamsT]):
    saga_id: uuid.UUID
    params: ParamsT
    data: dict[str, Any]
    """Every output recorded so far, as stored: read it typed with `get`."""
    app: App
    conn: asyncpg.Connection | None = None
    """The step's transaction, for local steps; None for remote ones."""
    error: str | None = None
    """While unwinding: why the saga failed."""
    done_here: tuple[str, ...] = ()
    """The steps done earlier in this same transaction (local steps that follow each other share one):
    what they locked is still locked."""

    @property
    def tx(self) -> asyncpg.Connection:
        assert self.conn is not None, "only a local step has a transaction"
        return self.conn

    def get(self, output: type[OutputT]) -> OutputT:
        """An earlier step's output, read back typed."""
        return output.model_validate(self.data)


Action = Callable[[Context[Any]], Awaitable[Output | None]]
Undo = Callable[[Context[Any]], Awaitable[None]]


@dataclass(frozen=True)
class Step:
    name: str
    """Stored in the saga's row and log: a saga in flight resumes by it, so it never changes."""
    action: Action
    undo: Undo | None = None
    local: bool = True
    """Run the action inside the transaction that records it (exactly once); False for remote actions."""
    undo_local: bool = True
    """Likewise for the undo."""


@dataclass(frozen=True)
class Saga:
    kind: str
    """Stored in the saga's row: never changes (see Step.name)."""
    steps: list[Step]
    params: type[Params] = Params

    def parse(self, params: Params | Mapping[str, Any]) -> Params:
        return params if isinstance(params, self.params) else self.params.model_validate(params)


def stored(model: BaseModel | None, *, sparse: bool = False) -> dict[str, Any]:
    """A model as the saga's JSON holds it; `sparse` leaves out what is None (parameters that were not
    given are not stored, as before they were models)."""
    return model.model_dump(mode="json", exclude_none=sparse) if model is not None else {}
