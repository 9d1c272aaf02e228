"""A stop ends a service's wait even when what it waits for comes at that moment (shared.waits)."""

import asyncio

import pytest

from shared.waits import woken


@pytest.mark.parametrize("turns", range(4))
async def test_a_stop_ends_a_loop_whose_event_comes_with_it(turns: int) -> None:
    """asyncio.wait_for on Python 3.11 swallowed this cancel for 0 to 2 turns between the event and the
    cancel: the loop went on waiting, and the service asked to stop never exited."""
    event = asyncio.Event()

    async def loop() -> None:
        while True:
            await woken(event, 10)
            event.clear()

    task = asyncio.create_task(loop())
    for _ in range(3):
        await asyncio.sleep(0)
    event.set()
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=1)
    assert task in done and task.cancelled()


async def test_woken_says_whether_the_event_came() -> None:
    event = asyncio.Event()
    assert not await woken(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await woken(event, 5)
