"""Group commit of saga steps: the local steps due of many sagas, in one transaction. Each saga's due
steps are the local step at its cursor and every local step right after it (a start's `place` and
`create_vmm`). Sagas whose steps fall due while a group commits wait, and go together in the next one
(shared.db.GroupCommit): one fence for all of them (their rows locked while this process holds their
leases), their instances locked in id order (one lock order: instances before the sleds a placement
reserves, as every other path takes them), each saga's steps in turn, one statement recording every step
done, one commit. A start's place and create_vmm are four statements of their own and four of
bookkeeping (begin, fence, record, commit); the sagas of a group share the four. Local steps only: a
step that talks to another service (a sled asked) never holds a group's locks while it waits.

A remote step done (a charge's outcome in, a sled asked) is recorded in a group too: its move joins the
group's one statement (`advance`, fenced by the lease like every move), so a saga costs no statement of
its own between its steps; a group of such records alone is that one statement, where each record's
outcome is its own (one whose saga had moved, or whose lease is another's, is told so; the others stand).

A group that runs steps is all or nothing, and a saga's failure stays its own: a step that raises
(StepFailed, a lost lease or connection, anything) rolls the group back, and each of its sagas runs again
alone, where what it raises is its own outcome, as if it had never been grouped. Steps of one saga never
run in two groups at once: a saga has one runner, which waits for its group."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import asyncpg

from services.instance_manager.base import Q
from services.instance_manager.sagas import progress
from services.instance_manager.sagas.definition import (
    Context,
    LeaseLost,
    Params,
    Saga,
    Status,
    StepFailed,
    stored,
)
from services.instance_manager.sagas.progress import Move
from shared import telemetry
from shared.crash import crash_point
from shared.db import GroupCommit

if TYPE_CHECKING:
    from services.instance_manager.sagas.engine import Executor

MOST = 8
"""Sagas in one group at most: their transaction holds the rows they lock (a start's sled reservation,
which an inventory being applied waits for) until the last of them is done."""
AT_ONCE = 2
"""Groups committing at once in a process: one fills while another commits."""


@dataclass(frozen=True)
class Due:
    """A saga as its runner saw it, and what it asks of a group: its due local steps run and recorded, or
    (`done`) a remote step it did recorded."""

    saga: Saga
    row: asyncpg.Record
    done: Move | None = None


@dataclass
class Together:
    """The steps of this process's sagas, recorded in groups (the local ones run there too)."""

    executor: Executor
    _groups: GroupCommit[Due, asyncpg.Record | Exception] = field(init=False)
    """Each request's outcome: the saga as it now is, or why its record alone did not stand."""

    def __post_init__(self) -> None:
        self._groups = GroupCommit(self._commit, most=MOST, at_once=AT_ONCE)

    async def run(self, saga: Saga, row: asyncpg.Record) -> asyncpg.Record:
        """Do the saga's due local steps and record them done, with other sagas' in the same transaction;
        the saga as it now is. Raises what its own steps raise."""
        return _own(await self._groups(Due(saga, row)))

    async def record(self, saga: Saga, done: Move) -> asyncpg.Record:
        """Record a remote step done (its move), with other sagas' steps; the saga as it now is.
        RuntimeError if the saga had moved, LeaseLost if its lease is another's (progress.advance)."""
        return _own(await self._groups(Due(saga, done[0], done)))

    async def _commit(self, group: list[Due]) -> list[asyncpg.Record | Exception]:
        x = self.executor
        moved: Mapping[uuid.UUID, asyncpg.Record | Exception]
        if all(due.done is not None for due in group):  # nothing runs: one statement, fenced by itself
            moved = await progress.advance_each(x.pool, x.owner, [due.done for due in group if due.done])
        else:
            moved = await self._run_and_record(group)
        if len(group) > 1:
            telemetry.count("saga.steps_grouped", len(group))
        return [moved[due.row["id"]] for due in group]

    async def _run_and_record(self, group: list[Due]) -> dict[uuid.UUID, asyncpg.Record]:
        """The group's transaction: fence, lock, run each saga's due local steps, record every move."""
        x = self.executor
        async with x.pool.acquire() as conn, conn.transaction():
            fenced = await progress.fence(conn, x.owner, [due.row for due in group])
            for due in group:
                if due.row["id"] not in fenced:
                    raise LeaseLost(due.row["id"])
            params = [due.saga.parse(due.row["params"]) if due.done is None else None for due in group]
            instances = {i for p in params if isinstance(i := getattr(p, "instance_id", None), uuid.UUID)}
            if instances:
                await conn.execute(Q["instances_lock"], sorted(instances, key=lambda i: i.int))
            moves = [
                due.done if p is None else await self._steps(conn, due.saga, due.row, p)
                for due, p in zip(group, params, strict=True)
            ]
            moved = await progress.advance(conn, x.owner, moves)
        x.app.relay.kick()  # what the steps wrote to the outbox goes now, not at the relay's next look
        return moved

    async def _steps(self, conn: asyncpg.Connection, saga: Saga, row: asyncpg.Record, params: Params) -> Move:
        """The saga's due local steps, on the group's connection, in the saga's own trace; a step that
        fails names itself."""
        data, cursor, done = dict(row["data"]), row["cursor"], []
        with telemetry.span(f"saga {saga.kind} steps", row["trace"], **{"saga.id": str(row["id"])}):
            while cursor < len(saga.steps) and saga.steps[cursor].local:
                step = saga.steps[cursor]
                if done:
                    crash_point(f"saga:{saga.kind}/{step.name}")
                try:
                    ctx = Context(row["id"], params, data, self.executor.app, conn, done_here=tuple(done))
                    out = stored(await step.action(ctx))
                except StepFailed as e:
                    e.step = e.step or step.name
                    raise
                data = {**data, **out}
                done.append(step.name)
                cursor += 1
        status = Status.done if cursor >= len(saga.steps) else Status.running
        return (row, done, data, status, len(done))


def _own(outcome: asyncpg.Record | Exception) -> asyncpg.Record:
    """A request's outcome: the saga as it now is, or the exception its record alone raised."""
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
