"""Looking again before reporting: what holds only at rest fails for a moment while work is in flight (a
saga, a charge on its way), so a finding counts only once it has lasted.

`rackctl check --settle` and `rackctl usage audit --settle` both wait this way.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rackctl.output import Progress

T = TypeVar("T")


async def settled(
    look: Callable[[], Awaitable[list[T]]],
    seconds: float,
    *,
    label: str,
    status: Callable[[list[T], float], str],
) -> list[T]:
    """What `look` finds once it holds still: looked at again each second while it finds something, for
    up to `seconds` (0: the first look); what is still found then is returned. While it waits, a line on
    stderr (terminals only) says what it waits for: `status(found, seconds_left)`."""
    deadline = time.monotonic() + seconds
    progress = Progress(label, out=sys.stderr)
    try:
        while True:
            found = await look()
            left = deadline - time.monotonic()
            if not found or left <= 0:
                return found
            progress.update(status(found, left))
            await asyncio.sleep(min(1.0, left))
    finally:
        progress.clear()
