"""Durable sagas: a saga is a list of named steps, each with its undo; a reader sees the whole flow in
the saga's definition before reading any step. Its parameters are a pydantic model (`Params`), and each
step's output one too (`Output`), read back typed by the steps after it (`Context.get`).

Guarantees:
- Progress is logged: a step's completion (and its outputs) is committed before the next step begins.
  A *local* step runs inside the very transaction that records its completion, so it happens exactly
  once; local steps that follow each other share that transaction (one fence, one record of their
  progress, one commit), so a crash or a failure in any of them leaves none of them done. A remote step
  (one that talks to another service) may run again after a crash, so it must be idempotent; that is
  how its messages need no outbox: the saga log is one.
- The first step runs inside the caller's transaction (`begin`): that is where an interlock goes, so a
  refused request creates no saga at all.
- A step that raises `StepFailed` makes the saga unwind: every completed step's undo runs, newest first.
  Undos are idempotent and retried until they succeed. Any other exception is transient: the step is
  retried with backoff.
- A remote step's effect may be there already when it runs again (a crash came after its action and
  before the commit of its progress, or an ack was lost): it must then succeed, and never unwind what
  it did.
- At most `AT_ONCE` sagas that nobody waits for (restarts, a pool keeper's, resumed ones) run at a time in
  a process, the rest wait their turn before their second step; a user's command never waits behind
  them (docs/architecture.md, "Sagas take turns"). Saga steps have connections of their own.
- The sagas callers wait for are counted in hand (`active`), and every saga's end in the pace (pace.py):
  `busy` refuses a new one at once rather than leave it to time out. Restart orders are held to the same
  backlog, counted over the sagas nobody waits for: begun by the ten thousand after a power loss, each
  would be charged and hold a lease while it waited its turn.
- After a crash, `resume` picks up every unfinished saga. A saga runs in one process at a time, under
  a lease kept in its row (`lease_owner`, `lease_until`), not under anything a connection holds: the
  lease is taken only when free or expired, renewed while the process runs (one statement for all its
  sagas), and every step's commit is fenced by it (the step's transaction first locks the saga row while
  `lease_owner` is this process). A lost connection, a database restart or a stalled process thus never
  lets two processes commit steps of one saga: one whose lease was taken commits nothing more, and stops
  running that saga. Each step's event names the process that ran it (the checker's no_saga_run_twice).
- The stored shape: `params` is the parameters' JSON, `data` every output so far merged into one JSON
  object (so output fields are unique within a saga); sagas in flight resume by kind and step name.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import asyncpg

from services.instance_manager.sagas import pace as pacing
from services.instance_manager.sagas import progress
from services.instance_manager.sagas.definition import (
    Context,
    LeaseLost,
    Params,
    Saga,
    Status,
    Step,
    StepFailed,
    stored,
)
from services.instance_manager.sagas.progress import LEASE, SQL, Move
from services.instance_manager.sagas.together import Together
from shared import metrics, telemetry
from shared.crash import crash_point

if TYPE_CHECKING:
    from services.instance_manager.app import App

log = logging.getLogger(__name__)
RENEW = 2.5
"""Seconds between two renewals of a process's leases."""
AT_ONCE = 256
"""Sagas nobody waits for that run at once in one process. A start spends most of its time waiting (its
charge goes through accounting and back), so sagas done a second is about AT_ONCE over one saga's time:
64 held the restarts after a rack-wide power loss to 22 a second where fresh starts ran at 39."""
BEGUN_KEPT = 4096
"""Sagas begun here and not launched yet whose inserted rows are kept (Executor._begun)."""
TRANSIENT = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError)
"""What a lost connection or a database restart raises: tried again, never a step's failure."""


def process_owner() -> str:
    """A name for this process, unique among every process that ever runs sagas (host and pid say which
    it was, the random part keeps a reused pid from passing for its predecessor)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


@dataclass
class Executor:
    """Runs sagas of the kinds it knows; one per process."""

    app: App
    dsn: str
    kinds: dict[str, Saga] = field(default_factory=dict)
    retry_delay: float = 0.2
    owner: str = field(default_factory=lambda: process_owner())
    """This process's name on the leases it holds and the steps it logs: unique to the process."""
    _running: dict[uuid.UUID, asyncio.Task[Status]] = field(default_factory=dict)
    _turns: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(AT_ONCE))
    active: int = 0
    """Sagas a caller waits for (a user's create, start or migration) being driven now: what the
    backpressure counts. Those nobody waits for are bounded by AT_ONCE and never delay a user's."""
    pace: pacing.Pace = field(default_factory=pacing.Pace)
    backlog: float = 5.0
    """Seconds of saga work this replica takes in hand before it answers `busy` (RACKPLANE_SAGA_BACKLOG)."""
    resume_interval: float = 2.0
    """How often it looks for unfinished sagas no process runs (RACKPLANE_SAGA_RESUME_INTERVAL)."""
    _promised: list[float] = field(default_factory=list)
    """When the callers told `busy` were told to come back (monotonic, sorted; past ones forgotten)."""
    _promised_background: list[float] = field(default_factory=list)
    """The same for restart orders: each kind's line is its own."""
    _together: Together = field(init=False)
    _begun: dict[uuid.UUID, tuple[float, asyncpg.Record]] = field(default_factory=dict)
    """Sagas `begin` recorded, as their insert left them, until launched: their lease is this process's
    from the start, so the first launch neither takes it nor reads the saga back. Bounded: a saga whose
    caller rolled back is never launched, and the oldest entries go (a launch that misses its entry
    takes the lease and reads the saga, as a resume does)."""

    def __post_init__(self) -> None:
        self._together = Together(self)

    def register(self, saga: Saga) -> None:
        self.kinds[saga.kind] = saga

    @property
    def pool(self) -> asyncpg.Pool:
        return self.app.saga_pool

    async def begin(self, conn: asyncpg.Connection, saga: Saga, params: Params) -> uuid.UUID:
        """Run the first step in the caller's transaction and record the saga; `launch` it after commit."""
        saga_id = uuid.uuid4()
        typed = saga.parse(params)
        first = saga.steps[0]
        out = stored(await first.action(Context(saga_id, typed, {}, self.app, conn)))
        self._begun[saga_id] = (
            time.monotonic(),
            await conn.fetchrow(
                SQL["insert"],
                saga_id,
                saga.kind,
                stored(typed, sparse=True),
                out,
                telemetry.current_traceparent(),
                [first.name],
                self.owner,
                LEASE,
            ),
        )
        while len(self._begun) > BEGUN_KEPT:
            del self._begun[next(iter(self._begun))]
        return saga_id

    def launch(self, saga_id: uuid.UUID, *, waited_for: bool = False) -> asyncio.Task[Status]:
        """Run (or resume) a saga in the background; the task's result is its final status. A saga a
        caller is waiting for (a user's command) runs at once; the others take turns."""
        task = self._running.get(saga_id)
        if task is None:
            task = asyncio.create_task(self._run_waited(saga_id) if waited_for else self._run(saga_id))
            self._running[saga_id] = task
            task.add_done_callback(lambda _: self._running.pop(saga_id, None))
        return task

    async def resume(self) -> int:
        """Launch every unfinished saga that no live process is running (its lease free, expired, or
        ours). Returns how many were found."""
        rows = await self.pool.fetch(SQL["unfinished"], self.owner)
        for r in rows:
            if r["id"] not in self._running:
                self.launch(r["id"])
        return len(rows)

    async def resume_forever(self) -> None:
        """Resume what no live process runs, every RACKPLANE_SAGA_RESUME_INTERVAL, and keep this process's
        leases renewed meanwhile; release them when stopped, so that another process resumes at once."""
        renewing = asyncio.create_task(self.renew_forever())
        try:
            while True:
                try:
                    await self.resume()
                except Exception as e:
                    log.warning("saga resume pass failed: %s", e)
                await asyncio.sleep(self.resume_interval)
        finally:
            renewing.cancel()
            await self.release()

    async def renew_forever(self) -> None:
        """Renew every lease this process holds, every RENEW seconds, in one statement."""
        while True:
            try:
                await self.pool.execute(SQL["leases_renew"], self.owner, LEASE)
            except Exception as e:  # the leases last LEASE: the next renewals may still make it
                log.warning("saga lease renewal failed: %s", e)
                telemetry.count("saga.lease_renewals_failed")
            await asyncio.sleep(RENEW)

    async def release(self) -> None:
        """Give up this process's leases (it stops): other processes resume its sagas at once."""
        for task in list(self._running.values()):
            task.cancel()
        try:
            async with asyncio.timeout(2.0):
                await self.pool.execute(SQL["leases_release"], self.owner)
        except Exception as e:  # they expire on their own
            log.info("saga leases not released (%s): they expire within %gs", e, LEASE)

    async def error(self, saga_id: uuid.UUID) -> str | None:
        return await self.pool.fetchval(SQL["error"], saga_id)

    async def data(self, saga_id: uuid.UUID) -> dict[str, Any]:
        """What the saga's steps have recorded so far."""
        row = await self._load(saga_id)
        return dict(row["data"]) if row else {}

    async def wait_idle(self) -> None:
        while self._running:
            await asyncio.gather(*self._running.values(), return_exceptions=True)

    # --- running one saga ---

    async def _run(self, saga_id: uuid.UUID) -> Status:
        async with self._turns:
            return await self._run_now(saga_id)

    def busy(self, starting: int = 0, *, waited_for: bool = True) -> tuple[int, int, float] | None:
        """Backpressure: None while the sagas in hand (those callers wait for, plus `starting`: commands
        about to begin one) are fewer than this replica finishes (of every kind) in
        RACKPLANE_SAGA_BACKLOG seconds at its measured rate; else (milliseconds until they would be, sagas
        in hand, rate). `waited_for=False` counts the sagas nobody waits for instead (a restart order's):
        they take turns apart from callers' (AT_ONCE), so each kind is held to the backlog on its own."""
        in_hand = self.active if waited_for else len(self._running) - self.active
        promised = self._promised if waited_for else self._promised_background
        return pacing.busy(self.pace, promised, in_hand + starting, self.backlog, time.monotonic())

    async def _run_waited(self, saga_id: uuid.UUID) -> Status:
        """A saga a caller waits for, counted in hand (`active`) while it runs."""
        self.active += 1
        try:
            return await self._run_now(saga_id)
        finally:
            self.active -= 1

    async def _run_now(self, saga_id: uuid.UUID) -> Status:
        """Drive the saga (`_take_and_drive`), counted in the pace once it is over."""
        status = await self._take_and_drive(saga_id)
        if status.over:
            self.pace.tick(time.monotonic())
        return status

    async def _take_and_drive(self, saga_id: uuid.UUID) -> Status:
        """Take the saga's lease and drive it: "busy" if another process holds the lease, "lost" if
        another took it while this one ran (it goes on there), else the saga's final status. A saga this
        process began is driven from the row its insert returned, under the lease it was inserted with."""
        tries = 0
        began, begun = self._begun.pop(saga_id, (0.0, None))
        if time.monotonic() - began > LEASE / 2:  # launched late: its lease may have lapsed meanwhile
            begun = None
        while begun is None:
            try:
                if await self.pool.fetchval(SQL["lease_take"], saga_id, self.owner, LEASE) is not None:
                    break
                lease = await self.pool.fetchrow(SQL["lease"], saga_id, self.owner)
                tries += 1
                if lease is None or not lease["ours_or_free"] or tries > 10:
                    return Status.busy  # another process runs it, or it is over
                # Ours or free, and its row locked a moment (a renewal): take it once that is over.
            except TRANSIENT as e:
                log.info("saga %s: cannot take its lease yet (%s)", saga_id, e)
            await asyncio.sleep(self.retry_delay)
        try:
            return await self._drive(saga_id, begun)
        except LeaseLost:
            log.warning("saga %s: its lease was taken by another process, which runs it now", saga_id)
            telemetry.count("saga.leases_lost")
            return Status.lost

    async def _drive(self, saga_id: uuid.UUID, row: asyncpg.Record | None = None) -> Status:
        attempt = 0
        # `row`: the saga as a step's commit (or its insert) left it; read afresh after anything else.
        while True:
            if row is None:
                try:
                    row = await self._load(saga_id)
                except TRANSIENT as e:
                    log.info("saga %s: cannot read its progress yet (%s)", saga_id, e)
                    await asyncio.sleep(self.retry_delay)
                    continue
            status = Status(row["status"]) if row is not None else Status.missing
            if row is None or status.over:
                return status
            saga = self.kinds[row["kind"]]
            forward = status is Status.running
            step = saga.steps[row["cursor"]]
            try:
                crash_point(f"saga:{saga.kind}/{step.name if forward else f'undo:{step.name}'}")
                with (
                    metrics.timed(
                        "rackplane.saga.step.duration",
                        saga=saga.kind,
                        step=step.name if forward else f"undo {step.name}",
                    ),
                    telemetry.span(
                        f"saga {saga.kind} {'' if forward else 'undo '}{step.name}",
                        row["trace"],
                        **{"saga.id": str(saga_id)},
                    ),
                ):
                    if forward:
                        row = await self._forward(saga, row, step)
                    else:
                        row = await self._backward(saga, row, step)
                attempt = 0
            except StepFailed as e:
                failed, row = row, None
                try:
                    await self._start_unwinding(failed, e.step or step.name, e.reason)
                except LeaseLost:
                    raise
                except Exception as x:  # not recorded: the step runs again, and fails again
                    log.warning("saga %s %s: cannot start unwinding yet: %s", failed["kind"], saga_id, x)
                    await asyncio.sleep(self.retry_delay)
            except (asyncio.CancelledError, LeaseLost):
                raise
            except Exception as e:
                failed, row = row, None
                attempt += 1
                log.warning(
                    "saga %s %s/%s: attempt %d failed: %s", failed["kind"], saga_id, step.name, attempt, e
                )
                telemetry.count("saga.step_retries")
                await asyncio.sleep(min(self.retry_delay * 2 ** min(attempt, 5), 5.0))

    async def _load(self, saga_id: uuid.UUID) -> asyncpg.Record | None:
        return await self.pool.fetchrow(SQL["load"], saga_id)

    async def _forward(self, saga: Saga, row: asyncpg.Record, step: Step) -> asyncpg.Record:
        """Do a step and record it done; the saga as it now is. A local step runs in the transaction that
        records it, with the local steps right after it; a remote one is recorded once it is done; both
        with other sagas' (together.py)."""
        if step.local:
            return await self._together.run(saga, row)
        data = dict(row["data"])
        params = saga.parse(row["params"])
        out = stored(await step.action(Context(row["id"], params, data, self.app, None)))
        crash_point(f"saga:{saga.kind}/after:{step.name}")  # done, and not yet recorded as done
        status = Status.done if row["cursor"] + 1 >= len(saga.steps) else Status.running
        return await self._together.record(saga, (row, [step.name], {**data, **out}, status, +1))

    async def _backward(self, saga: Saga, row: asyncpg.Record, step: Step) -> asyncpg.Record:
        data = dict(row["data"])
        status = Status.failed if row["cursor"] == 0 else Status.unwinding
        ctx = Context(row["id"], saga.parse(row["params"]), data, self.app, None, row["error"])
        if step.undo is not None and not step.undo_local:
            await step.undo(ctx)
            crash_point(f"saga:{saga.kind}/after:undo:{step.name}")
        async with self.pool.acquire() as conn, conn.transaction():
            await self._fence(conn, row)
            if step.undo is not None and step.undo_local:
                ctx.conn = conn
                await step.undo(ctx)
            undone = await self._advance(conn, (row, [step.name], data, status, -1), event="undone")
        self.app.relay.kick()
        return undone

    async def _advance(
        self, conn: asyncpg.Connection | asyncpg.Pool, move: Move, event: str = "done"
    ) -> asyncpg.Record:
        return (await progress.advance(conn, self.owner, [move], event))[move[0]["id"]]

    async def _fence(self, conn: asyncpg.Connection | asyncpg.Pool, row: asyncpg.Record) -> None:
        if not await progress.fence(conn, self.owner, [row]):
            raise LeaseLost(row["id"])

    async def _start_unwinding(self, row: asyncpg.Record, step: str, reason: str) -> None:
        log.info("saga %s %s: step %s failed: %s; unwinding", row["kind"], row["id"], step, reason)
        moved = await self.pool.fetchval(SQL["unwind"], row["id"], reason, row["cursor"], self.owner, step)
        if moved is None:
            await self._fence(self.pool, row)  # the lease is another's: LeaseLost
            raise RuntimeError(f"saga {row['id']} moved under us")
