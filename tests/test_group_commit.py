"""Group commit (shared/db/group_commit.py): requests that come while a batch is applied go together in
the next one, each gets its own result, and a batch that fails is tried again a request at a time so
that only the bad one fails."""

from __future__ import annotations

import asyncio

import pytest

from shared.db import GroupCommit


class Ledger:
    """Applies batches of numbers, slowly enough for others to queue; a negative number cannot be
    applied, and fails its whole batch."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    async def apply(self, batch: list[int]) -> list[int]:
        await asyncio.sleep(0.01)
        if any(n < 0 for n in batch):
            raise ValueError(f"{min(batch)} is negative")
        self.batches.append(batch)
        return [n * 10 for n in batch]


async def test_requests_that_arrive_during_a_batch_share_the_next_one() -> None:
    ledger = Ledger()
    group = GroupCommit(ledger.apply, most=3)
    first = asyncio.create_task(group(0))
    await asyncio.sleep(0)  # the first goes alone: nothing else is waiting yet
    results = await asyncio.gather(first, *(group(n) for n in range(1, 6)))
    assert results == [0, 10, 20, 30, 40, 50]
    assert ledger.batches == [[0], [1, 2, 3], [4, 5]]  # in arrival order, at most 3 together


async def test_a_request_that_fails_fails_alone() -> None:
    ledger = Ledger()
    group = GroupCommit(ledger.apply, most=10)
    first = asyncio.create_task(group(0))
    await asyncio.sleep(0)
    results = await asyncio.gather(first, group(1), group(-1), group(2), return_exceptions=True)
    assert results[:2] == [0, 10] and results[3] == 20
    assert isinstance(results[2], ValueError) and "-1 is negative" in str(results[2])
    assert ledger.batches == [[0], [1], [2]]  # the failed batch, again one at a time


async def test_a_caller_that_gives_up_leaves_the_others_their_results() -> None:
    ledger = Ledger()
    group = GroupCommit(ledger.apply, most=10)
    first = asyncio.create_task(group(0))
    await asyncio.sleep(0)
    quitter = asyncio.create_task(group(1))
    stayer = asyncio.create_task(group(2))
    await asyncio.sleep(0)
    quitter.cancel()
    assert await first == 0 and await stayer == 20
    with pytest.raises(asyncio.CancelledError):
        await quitter
    assert ledger.batches == [[0], [1, 2]]  # it was applied all the same: its caller only stopped waiting


async def test_batches_go_at_once_up_to_at_once() -> None:
    """With `at_once` 2, a second batch is applied while the first still is (one fills while another
    commits), and never a third."""
    busy, most_busy = 0, 0
    release = asyncio.Event()

    async def apply(requests: list[int]) -> list[int]:
        nonlocal busy, most_busy
        busy += 1
        most_busy = max(most_busy, busy)
        await release.wait()
        busy -= 1
        return requests

    group = GroupCommit(apply, most=1, at_once=2)
    waiting = [asyncio.create_task(group(i)) for i in range(5)]
    await asyncio.sleep(0.05)
    assert busy == 2
    release.set()
    assert await asyncio.gather(*waiting) == [0, 1, 2, 3, 4]
    assert most_busy == 2


@pytest.mark.parametrize("at_once", [1, 2])
async def test_a_request_made_as_soon_as_the_last_is_answered_is_applied(at_once: int) -> None:
    """A caller that asks again the moment its answer comes (a saga's next step) finds a worker for it:
    the one that answered it is gone from the count as it finishes, not a step later."""
    ledger = Ledger()
    group = GroupCommit(ledger.apply, most=10, at_once=at_once)

    async def twice(n: int) -> tuple[int, int]:
        first = await group(n)
        return first, await group(n + 1)  # no await in between: asked in the step it was answered

    assert await asyncio.wait_for(asyncio.gather(twice(1), twice(3)), 2) == [(10, 20), (30, 40)]
