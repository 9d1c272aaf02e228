"""The database the auditing commands read (`rackctl check`, `rackctl usage audit`): read-only, across
every service's schema, so that what they report is what the tables hold, not what a service says."""

from __future__ import annotations

import argparse
import asyncio

import asyncpg

from rackctl.commands.base import CONNECT_TIMEOUT
from shared.config import check_database_url
from shared.errors import unreachable


def database_url_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--database-url",
        metavar="URL",
        default=None,
        help="the database (default: $DATABASE_URL, else the read-only login `make run` wrote under "
        "$RACKPLANE_HOME, default .rackplane)",
    )


async def connect(args: argparse.Namespace) -> asyncpg.Connection:
    """A connection to --database-url (or the default), or ConnectionError: one line, within the
    connect timeout."""
    within = min(CONNECT_TIMEOUT, args.timeout)
    try:
        async with asyncio.timeout(within):
            return await asyncpg.connect(args.database_url or check_database_url())
    except TimeoutError:
        raise ConnectionError(f"cannot reach the database within {within:g}s") from None
    except (OSError, asyncpg.PostgresError) as e:
        raise ConnectionError(f"cannot reach the database: {unreachable(e)}") from None
