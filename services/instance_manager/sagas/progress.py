"""A saga's progress, in its row and its log (saga.sql): the fence a step's transaction begins with, and
the statement that moves sagas on and logs their steps, for one saga or for a group at once
(together.py)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import asyncpg

from services.instance_manager.sagas.definition import LeaseLost, Status
from shared.db import queries

SQL = queries(Path(__file__).with_name("saga.sql"))
LEASE = 10.0
"""Seconds a saga's lease lasts unless renewed. Every RENEW seconds the process renews all of its leases
in one statement, so a lease outlives three failed renewals in a row (a database restart of several
seconds): a process that only lost its connection keeps its sagas. A process that died (kill -9, no
release) holds its sagas up for at most LEASE plus the resume interval before another process resumes
them; shorter would renew more often and lose leases to a busy database, longer would leave a crashed
replica's sagas (an instance half started) waiting longer."""
Move = tuple[asyncpg.Record, list[str], dict[str, Any], Status, int]
"""A saga's move: its row as its runner saw it, the steps done (or undone), its data and status after
them, and how far its cursor moves."""


async def fence(
    conn: asyncpg.Connection | asyncpg.Pool, owner: str, rows: list[asyncpg.Record]
) -> set[uuid.UUID]:
    """Lock the sagas' rows, those whose lease process `owner` holds (returned): the first statement of a
    step's transaction, so that a step commits only under its saga's lease, and nobody takes the lease
    before it has."""
    return {r["id"] for r in await conn.fetch(SQL["lease_fence"], [row["id"] for row in rows], owner)}


async def advance(
    conn: asyncpg.Connection | asyncpg.Pool, owner: str, moves: list[Move], event: str = "done"
) -> dict[uuid.UUID, asyncpg.Record]:
    """Move each saga on (or back) by its move, and log each of its steps, in one statement for them all,
    under `owner`'s leases (renewed); each saga as it now is, by id. RuntimeError if one had moved
    (LeaseLost if its lease is another's): in a transaction, the caller's to roll back."""
    moved = {}
    for saga_id, outcome in (await advance_each(conn, owner, moves, event)).items():
        if isinstance(outcome, Exception):
            raise outcome
        moved[saga_id] = outcome
    return moved


async def advance_each(
    conn: asyncpg.Connection | asyncpg.Pool, owner: str, moves: list[Move], event: str = "done"
) -> dict[uuid.UUID, asyncpg.Record | Exception]:
    """`advance`, each saga's outcome its own: its row as it now is, or (not moved) the RuntimeError or
    LeaseLost that says why. The moves go in by saga id, the order the fence takes their rows in."""
    moves = sorted(moves, key=lambda m: m[0]["id"].int)  # stable: a saga's steps keep their order
    rows = await conn.fetch(
        SQL["advance"],
        [row["id"] for row, *_ in moves],
        [data for _, _, data, _, _ in moves],
        [status.value for _, _, _, status, _ in moves],
        [move for *_, move in moves],
        [row["cursor"] for row, *_ in moves],
        [row["status"] for row, *_ in moves],
        [row["id"] for row, steps, *_ in moves for _ in steps],
        [step for _, steps, *_ in moves for step in steps],
        owner,
        LEASE,
        event,
    )
    moved: dict[uuid.UUID, asyncpg.Record | Exception] = {r["id"]: r for r in rows}
    missing = [row for row, *_ in moves if row["id"] not in moved]
    held = await fence(conn, owner, missing) if missing else set()
    for row in missing:
        moved[row["id"]] = (
            RuntimeError(f"saga {row['id']} moved under us") if row["id"] in held else LeaseLost(row["id"])
        )
    return moved
