"""Waits that a stop always ends.

On Python 3.11 `asyncio.wait_for` swallows a cancel that comes as what it waits for completes
(cpython gh-86296, fixed in 3.12): a loop waiting on an event then misses the stop and never exits.
`asyncio.timeout` has no such race, so every wait in a long-running loop goes through here.
"""

import asyncio
from contextlib import suppress


async def woken(event: asyncio.Event, within: float) -> bool:
    """Wait until `event` is set, at most `within` seconds; whether it is set."""
    with suppress(TimeoutError):
        async with asyncio.timeout(within):
            await event.wait()
    return event.is_set()
