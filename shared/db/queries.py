"""Named queries: SQL kept in .sql files beside the code that runs it, each statement under a
`-- name: NAME` line, loaded once per file."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.M)

QUERY_NAMES: dict[str, str] = {}
"""A named query's text -> its name, for the name of its span (shared/db/pool.py)."""


@cache
def queries(path: Path) -> dict[str, str]:
    """Named queries of a .sql file: each starts with a `-- name: NAME` line."""
    text = path.read_text()
    parts = _NAME.split(text)
    named = {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}
    QUERY_NAMES.update({body: name for name, body in named.items()})
    return named
