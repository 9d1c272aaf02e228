"""Which failures are the infrastructure's (retried for as long as it takes, answered `unavailable`) and
which are the message's (dead-lettered, answered `internal`): shared/errors.py."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import nats.errors
import pytest

from shared.errors import transient, unreachable


@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError("Connection lost"),
        TimeoutError(),
        asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.exceptions.DeadlockDetectedError("deadlock detected"),
        # what asyncpg raises on a connection the server ended mid-statement (seen under the soak's
        # killed database connections): the command was not served, and may be sent again
        asyncpg.exceptions.InternalClientError(
            "cannot switch to state 15; another operation (2) is in progress"
        ),
        nats.errors.ConnectionClosedError(),
    ],
)
def test_the_infrastructure_away_is_transient(error: Exception) -> None:
    assert transient(error)


@pytest.mark.parametrize(
    "error",
    [ValueError("bad"), KeyError("x"), asyncpg.exceptions.CheckViolationError("violates check constraint")],
)
def test_a_fault_of_the_message_or_the_code_is_not(error: Exception) -> None:
    assert not transient(error)


async def test_a_database_whose_socket_is_not_there_is_said_to_be_down_not_a_missing_file(
    tmp_path: Path,
) -> None:
    """What asyncpg raises for a Unix socket with no server behind it (the one-machine stack's database
    restarting) is FileNotFoundError, which alone would read like a missing file."""
    with pytest.raises(OSError) as e:
        await asyncpg.connect(f"postgresql://nobody@/db?host={tmp_path}&port=5999", timeout=5)
    assert unreachable(e.value) == "nothing listens on its Unix socket (the server is down or restarting)"
    assert transient(e.value)
    assert unreachable(ConnectionRefusedError(111, "Connection refused")).startswith("ConnectionRefusedError")
