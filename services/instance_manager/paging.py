"""Lists a page at a time: each list query takes a cursor and a limit, in a stable order, and fetches one
row more than asked, so that the reply can say whether another page follows without a count."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import asyncpg

from shared import bus

SEPARATOR = "/"
"""Names never hold it (shared.messages.NAME_PATTERN), so a cursor of names splits back unambiguously."""


def after(cursor: str | None, keys: int) -> list[str | None]:
    """The key columns a cursor stands for (all None on the first page)."""
    if cursor is None:
        return [None] * keys
    parts = cursor.split(SEPARATOR)
    if len(parts) != keys or not all(parts):
        raise bus.CommandError("invalid", f"not a cursor of this list: {cursor!r}")
    return list(parts)


def page(
    rows: Sequence[asyncpg.Record], limit: int, key: Callable[[asyncpg.Record], tuple[str, ...]]
) -> tuple[Sequence[asyncpg.Record], str | None]:
    """The page's rows, and the cursor of the next page (None when this one is the last)."""
    if len(rows) <= limit:
        return rows, None
    return rows[:limit], SEPARATOR.join(key(rows[limit - 1]))


def reply(items: list[Any], next_cursor: str | None) -> dict[str, Any]:
    return {"items": items, "next": next_cursor}
