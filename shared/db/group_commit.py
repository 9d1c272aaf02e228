"""Group commit: requests that arrive while a batch is being applied go together in the next one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class GroupCommit(Generic[T, R]):
    """Requests that arrive while a batch of them is being applied wait, and go together in the next one:
    one transaction for many, as a database's group commit does. Each statement costs a round trip
    whatever it carries (docs/benchmarks.md), so a burst of small orders costs about as much as one.

    `apply` takes the requests, in arrival order, and returns one result each. A batch that fails is
    tried again one request at a time, so that a request that cannot be applied fails alone. Up to
    `at_once` batches are applied at a time (one fills while another commits)."""

    def __init__(
        self, apply: Callable[[list[T]], Awaitable[list[R]]], *, most: int, at_once: int = 1
    ) -> None:
        self.apply = apply
        self.most = most
        self.at_once = at_once
        self._waiting: list[tuple[T, asyncio.Future[R]]] = []
        self._workers: set[asyncio.Task[None]] = set()

    async def __call__(self, request: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        if len(self._workers) < self.at_once:
            worker = asyncio.create_task(self._drain())
            self._workers.add(worker)
            worker.add_done_callback(self._workers.discard)
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting[: self.most], self._waiting[self.most :]
                await self._settle(batch)
        finally:  # gone from the count in the same step as its last look: a request after it starts another
            self._workers.discard(asyncio.current_task())  # type: ignore[arg-type]

    async def _settle(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self.apply([request for request, _ in batch])
        except Exception as e:
            if len(batch) > 1:
                for one in batch:
                    await self._settle([one])
                return
            if not batch[0][1].done():
                batch[0][1].set_exception(e)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():  # its caller may have given up
                future.set_result(result)
