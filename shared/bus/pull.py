"""Fetching from a durable pull consumer: one pull request and one wait a batch."""

from __future__ import annotations

import asyncio
import json
from contextlib import suppress
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from shared.bus.errors import FetchFailed
from shared.topology import jsapi


class Pull:
    """Fetches from one durable pull consumer: each fetch is one pull request, whose messages a callback
    collects into a list, and one wait until the request is over (its batch delivered, or the broker's
    status that ends it).

    nats-py's `fetch` waits for each message of a batch with a task and a timer of its own (`next_msg`):
    a tenth of what a consumer of a thousand-message batch spends (docs/benchmarks.md, the accounting
    benchmark). The request asks for what is there at once (`no_wait`), waiting up to `timeout` for a
    first message when there is none, so a fetch returns as soon as messages have come, as nats-py's
    does. Each request has a reply subject of its own (`<inbox>.<n>`), so a status that ends an earlier
    request, one given up on, is told apart; messages it delivers late are kept for the next fetch (they
    are ordinary deliveries: acked once handled, or redelivered after the ack wait)."""

    MARGIN = 0.25
    """Seconds past the request's expiry that a fetch waits for the broker's status that ends it, before
    taking it as forgotten (a broker that restarted forgets pending pulls) and asking again."""

    def __init__(self, js: JetStreamContext, stream: str, durable: str) -> None:
        self.nc: NATS = js._nc
        self.next_subject = jsapi.consumer("MSG.NEXT", stream, durable, api=js._prefix)
        self.inbox = self.nc.new_inbox()
        self._sub: Any = None
        self._request = 0
        self._wanted = 0
        self._got: list[Msg] = []
        self._over: asyncio.Future[None] | None = None
        self._error: FetchFailed | None = None

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """Up to `batch` messages, as soon as there are some; TimeoutError if none came in `timeout`."""
        if self._sub is None:
            self._sub = await self.nc.subscribe(f"{self.inbox}.*", cb=self._delivered)
        if not self._got:  # what an earlier request delivered late is handed out first, without asking
            self._request += 1
            self._wanted, self._error = batch, None
            self._over = over = asyncio.get_running_loop().create_future()
            ask = {"batch": batch, "expires": int(timeout * 1e9), "no_wait": True}
            await self.nc.publish(
                self.next_subject, json.dumps(ask).encode(), reply=f"{self.inbox}.{self._request}"
            )
            with suppress(TimeoutError):  # not wait_for (shared.waits says why)
                async with asyncio.timeout(timeout + self.MARGIN):
                    await over
        msgs, self._got = self._got[:batch], self._got[batch:]
        if not msgs:
            if self._error is not None:
                raise self._error
            raise TimeoutError
        return msgs

    async def _delivered(self, msg: Msg) -> None:
        """A message of the consumer, or the broker's status on a request (its reply subject is ours)."""
        if not msg.subject.startswith(self.inbox):
            self._got.append(msg)
            if len(self._got) >= self._wanted:
                self._end()
            return
        if msg.subject != f"{self.inbox}.{self._request}":
            return  # the end of a request given up on
        status = (msg.headers or {}).get(api.Header.STATUS, "")
        if status == "100":  # a heartbeat
            return
        description = (msg.headers or {}).get(api.Header.DESCRIPTION, "")
        if status not in ("404", "408"):  # 404, 408: nothing more to deliver, or the request expired
            why = "no such consumer" if status == "503" else description.strip() or "no description"
            self._error = FetchFailed(f"{self.next_subject}: {status} {why}")
        self._end()

    def _end(self) -> None:
        if self._over is not None and not self._over.done():
            self._over.set_result(None)

    async def close(self) -> None:
        """Stop listening (best effort: the connection may be gone already)."""
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
