"""Sagas take turns (services/instance_manager/sagas/engine.py AT_ONCE): however many are launched in the
background, at most AT_ONCE run at a time in a process, the rest wait before their second step, and every
one is run; a saga a caller waits for (a user's command) runs at once."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.instance_manager.sagas import Executor
from services.instance_manager.sagas import engine as saga


async def test_no_more_than_at_once_sagas_run_together_and_all_run(monkeypatch: pytest.MonkeyPatch) -> None:
    running, most, done = 0, 0, []

    async def run_now(self: Executor, saga_id: uuid.UUID) -> str:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.001)
        running -= 1
        done.append(saga_id)
        return "done"

    monkeypatch.setattr(Executor, "_run_now", run_now)
    sagas = Executor(app=None, dsn="")
    ids = [uuid.uuid4() for _ in range(5 * saga.AT_ONCE)]
    results = await asyncio.gather(*(sagas.launch(i) for i in ids))

    assert results == ["done"] * len(ids)
    assert sorted(done) == sorted(ids)
    assert most == saga.AT_ONCE
    assert not sagas._running


async def test_a_saga_a_caller_waits_for_never_waits_behind_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hold = asyncio.Event()

    async def run_now(self: Executor, saga_id: uuid.UUID) -> str:
        if saga_id not in users:
            await hold.wait()  # every turn taken, and held
        return "done"

    monkeypatch.setattr(Executor, "_run_now", run_now)
    sagas = Executor(app=None, dsn="")
    users = {uuid.uuid4()}
    background = [sagas.launch(uuid.uuid4()) for _ in range(2 * saga.AT_ONCE)]
    await asyncio.sleep(0)

    assert await asyncio.wait_for(sagas.launch(next(iter(users)), waited_for=True), 1) == "done"
    hold.set()
    assert await asyncio.gather(*background) == ["done"] * len(background)
