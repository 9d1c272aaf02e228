"""A command sent again gets the first copy's answer: the effect happens once.

A caller whose reply was lost (a broker node or a replica died with it, or it simply did not come in
time) sends the command again with the same envelope id (`bus.REQUEST`). Every command that changes
state claims that id as the first statement of the transaction that applies it, and records its answer
(the reply, or the saga it began and the instance that saga works on) in the same transaction, so that:

- a copy arriving after the first committed finds the record (`Answered`) and answers from it: the
  reply, or the same saga awaited wherever it runs now, never a second saga;
- two copies arriving at once (at two replicas) take turns on the record's primary key: the second's
  claim waits for the first's commit, then finds it;
- a command refused (its transaction rolled back) leaves nothing: a copy is decided afresh, and gets the
  same refusal unless what refused it has changed.

The records are pruned after an hour (prune.REPLIES_KEPT); a caller resends within its own timeout.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from shared import bus
from shared.db import queries

log = logging.getLogger(__name__)
SQL = queries(Path(__file__).with_name("replies.sql"))

Request = tuple[uuid.UUID, str] | None
"""A command's envelope id and the digest of what it asks (`bus.REQUEST`), or None: not to be recorded."""


class Answered(Exception):
    """A copy of this command was already applied: its record says what to answer. Raised inside the
    transaction, so that it rolls back; caught outside it."""

    def __init__(self, record: asyncpg.Record) -> None:
        super().__init__("already answered")
        self.reply: Any = record["reply"]
        self.saga_id: uuid.UUID | None = record["saga_id"]
        self.instance_id: uuid.UUID | None = record["instance_id"]


def current() -> Request:
    """The command being handled (its handler's task), for the handler to pass down explicitly: a
    command that runs another (a create from an empty pool starts it) records only itself."""
    return bus.REQUEST.get()


def derived(request: Request, step: str) -> Request:
    """The id of a command that `request` runs in its turn (the start of a create from an empty pool):
    the same for every copy of `request`, so a copy finds that command's record too."""
    return None if request is None else (uuid.uuid5(request[0], step), f"{request[1]}:{step}")


async def claim(conn: asyncpg.Connection, request: Request) -> None:
    """Claim the command's id, first thing in its transaction; `Answered` if a copy already committed
    it, `invalid` if the id was used for another command."""
    if request is None:
        return
    request_id, digest = request
    while await conn.fetchval(SQL["command_claim"], request_id, digest) is None:
        record = await conn.fetchrow(SQL["command_record"], request_id)
        if record is None:  # pruned between the two statements: claim it afresh
            continue
        if record["digest"] != digest:
            raise bus.CommandError("invalid", f"request id {request_id} was already used for another command")
        log.info("request %s came again: answered as its first copy was", request_id)
        raise Answered(record)


async def answered(
    conn: asyncpg.Connection,
    request: Request,
    reply: Any = None,
    *,
    saga_id: uuid.UUID | None = None,
    instance_id: uuid.UUID | None = None,
) -> None:
    """Record the command's answer in the transaction that applies it: its reply, or its saga."""
    if request is not None:
        await conn.execute(SQL["command_answered"], request[0], reply, saga_id, instance_id)
