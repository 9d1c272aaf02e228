"""Which failures are the infrastructure's, not the message's."""

from __future__ import annotations

import asyncpg
import nats.errors


def transient(e: BaseException) -> bool:
    """A failure that says nothing about the message: the database or the broker is away for a while
    (restarting, unreachable, shutting a connection down), or two transactions collided. Such a message
    is retried for as long as it takes, never dead-lettered: the dead-letter stream is for messages that
    can never be handled."""
    return isinstance(
        e,
        OSError
        | TimeoutError
        | asyncpg.PostgresConnectionError
        | asyncpg.InterfaceError
        | asyncpg.exceptions.OperatorInterventionError
        | asyncpg.exceptions.CannotConnectNowError
        | asyncpg.exceptions.TransactionRollbackError  # a deadlock or serialization failure: try again
        # asyncpg's protocol out of step, as it is left when the server ends a connection mid-statement
        # (pg_terminate_backend): "cannot switch to state 15; another operation (2) is in progress"
        | asyncpg.exceptions.InternalClientError
        | nats.errors.Error,
    )


def unreachable(e: BaseException) -> str:
    """One line for a failure to reach a server: a Unix socket that is not there (the server is down or
    restarting) says so, where the bare error would read like a missing file."""
    if isinstance(e, FileNotFoundError):
        return "nothing listens on its Unix socket (the server is down or restarting)"
    return f"{type(e).__name__}: {e}"
