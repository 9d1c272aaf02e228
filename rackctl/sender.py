"""Sending one operator command and getting its answer, for as long as a deadline: the resends of a command
whose reply did not come (with the same envelope id, which the services recognise), and the retries of
one refused with `retry after N ms`. `rackctl.client.Client` adds one method per command on top."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Self

from nats.aio.client import Client as NATS

from rackctl import context as contexts
from shared import bus
from shared.config import DEFAULT_NATS_URL
from shared.messages import Model, Paged, schema_of
from shared.topology import subjects

SOURCE = "rackctl"
ATTEMPT_SHARE, ATTEMPT_MOST = 0.5, 12.0
"""One send waits at most this share of the client's timeout for its reply (the rest is for sending it
again), and never longer than ATTEMPT_MOST seconds: a service answers every command it holds within 10 s
(instance-manager answers a saga still running then, `commands.SAGA_REPLY_WAIT`), so a reply not come
by 12 s was lost, and waiting longer (rackctl's timeout is 60 s) only delays the resend."""
NO_SERVICE_FOR = 5.0
"""Seconds a command that no service answers (no subscriber at all: a single process restarting, or no
stack) is sent again before the client says so: long enough for a process to come back, short enough
that `rackctl` against a stack that is not running fails at once, not after its whole timeout."""
RESEND_FIRST, RESEND_MOST = 0.1, 2.0
"""Seconds before the first resend of a command whose reply did not come, doubled at each, up to the
most (jitter added): a broker node or a replica being replaced is back within seconds."""
RECONNECT_POLL = 0.2
"""How often a send in flight looks whether the connection was replaced (its reply would be lost)."""


def resend_after(n: int) -> float:
    """Seconds to wait before the `n`th resend (from 0) of a command whose reply did not come."""
    return min(RESEND_FIRST * 2**n, RESEND_MOST) * (1 + random.uniform(0, bus.JITTER))


class CommandSender:
    """A connection that sends operator commands: each one until it is answered or its deadline passes."""

    def __init__(self, nc: NATS, timeout: float = 15.0) -> None:
        self.nc = nc
        self.timeout = timeout
        self.told_busy = 0
        """Commands told `busy` at least once (and sent again): what a burst's caller reports."""
        self.resent = 0
        """Commands sent again at least once because their reply did not come."""
        self.attempt_share = ATTEMPT_SHARE
        """The share of `timeout` one send waits for its reply (ATTEMPT_SHARE)."""

    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        timeout: float = 15.0,
        connect_within: float = 2.0,
        context: str | None = None,
    ) -> Self:
        """Connect with the credential of `context` (by default $RACKCTL_CONTEXT, else the `default`
        context that `make run` writes: see rackctl/context.py); `url` overrides the context's URL."""
        saved = contexts.load(context)
        url = url or os.environ.get("NATS_URL") or (saved.url if saved else DEFAULT_NATS_URL)
        nc = await bus.connect(
            url,
            SOURCE,
            retry_for=connect_within,
            seed_file=saved.nkey if saved else None,
            inbox_prefix=subjects.inbox_prefix(saved.identity) if saved and saved.identity else None,
            ca_file=saved.ca if saved else None,
        )
        return cls(nc, timeout)

    async def close(self) -> None:
        await self.nc.drain()

    async def call(self, subject: str, body: Model) -> Any:
        """Send a command and return its reply's data, for as long as the client's timeout, counted from
        the first send. One refused with `retry after N ms` is sent again after that time (with jitter); a
        `busy` one says so on stderr, once a command (instance-manager has more sagas than it can run).
        One whose reply did not come (none in time, no service subscribed while one is being replaced,
        the connection replaced meanwhile) is sent again, with the same envelope id, after a short
        backoff: every command is safe to send again (the services recognise the id: a command takes
        effect once, and its copy gets its answer). That says so on stderr too, once a command. Refusals
        (`conflict`, `not_found`, `stale`, ...) are answers, never sent again; `unavailable` from a service
        that cannot reach its database right now is sent again likewise (its transaction may or may not
        have committed: the copy finds out)."""
        first = time.monotonic()
        deadline = first + self.timeout
        request_id = uuid.uuid4()
        said_busy = said_resent = False
        resends = 0
        while True:
            try:
                return await self._send_once(subject, body, request_id, deadline)
            except bus.CommandError as e:
                if not isinstance(e, bus.NoReply) and e.code != "unavailable":
                    wait = self._retry_or_raise(e, deadline, said_busy)
                    said_busy = said_busy or e.code == "busy"
                    await asyncio.sleep(wait)
                    continue
                wait = resend_after(resends)
                resends += 1
                no_service = isinstance(e, bus.NoReply) and e.code == "unavailable"  # no subscriber
                if time.monotonic() + wait >= (
                    min(deadline, first + NO_SERVICE_FOR) if no_service else deadline
                ):
                    if e.code == "timeout":  # the whole wait, not the last send's
                        raise bus.NoReply(
                            "timeout", f"no reply on {subject} within {self.timeout:g}s"
                        ) from None
                    raise
                if not said_resent:
                    said_resent = True
                    self.resent += 1
                    print(f"{e.message}: sending it again, as the same request", file=sys.stderr)
            await asyncio.sleep(wait)

    def _retry_or_raise(self, e: bus.CommandError, deadline: float, said_busy: bool) -> float:
        """Seconds to wait before sending again a command refused with `retry after N ms`; raise `e` if it
        said no such thing, or if that would pass the deadline. A `busy` one says so, once a command."""
        wait = bus.retry_after(e)
        if wait is None or time.monotonic() + wait > deadline:
            raise e
        if e.code == "busy" and not said_busy:  # once a command: a burst's caller sees why it waits
            self.told_busy += 1
            print(f"instance-manager busy: retrying in {wait * 1000:.0f} ms", file=sys.stderr)
        return wait

    async def _send_once(self, subject: str, body: Model, request_id: uuid.UUID, deadline: float) -> Any:
        """One send, waiting `attempt_share` of the timeout at most (what is left, if less); NoReply `lost`
        as soon as the connection is replaced while it waits (a reply meant for the old one is gone)."""
        wait = max(min(deadline - time.monotonic(), self.timeout * self.attempt_share, ATTEMPT_MOST), 0.01)
        reconnects = self.nc.stats["reconnects"]
        send = asyncio.ensure_future(
            bus.request(self.nc, subject, body, source=SOURCE, timeout=wait, request_id=request_id)
        )
        try:
            while not send.done():
                await asyncio.wait({send}, timeout=RECONNECT_POLL)
                if not send.done() and self.nc.stats["reconnects"] != reconnects:
                    raise bus.NoReply("lost", f"the connection was replaced while {subject} was out")
            return send.result()
        finally:
            if not send.done():
                send.cancel()

    async def pages(self, body: Paged) -> AsyncIterator[list[Any]]:
        """A list command's items, a page at a time (each page one request, in the list's order)."""
        while True:
            page = await self.send(body)
            yield page["items"]
            if page["next"] is None:
                return
            body = body.model_copy(update={"after": page["next"]})

    async def every(self, body: Paged) -> list[Any]:
        """All of a list command's items, through every page."""
        return [item async for page in self.pages(body) for item in page]

    async def send(self, body: Model) -> Any:
        """Send an operator command on the subject its schema and silo name (`rp.cmd.<silo>.<schema's
        resource>.<verb>`), for callers that built and validated the body themselves."""
        resource, verb = subjects.schema_parts(schema_of(body)[0], "cmd")
        return await self.call(subjects.command(getattr(body, "silo", None), resource, verb), body)
