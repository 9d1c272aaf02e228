"""The connection: one that reconnects forever (the default gives up after about two minutes), with the
client's own credential (an nkey seed), its private reply inbox, and TLS when a CA is given; and the
broker's permission denials on it, so that a request it refuses fails at once with a clear reason."""

from __future__ import annotations

import asyncio
import logging
import ssl
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
import nats.errors
from nats.aio.client import Client as NATS

from shared.bus.errors import CommandError

log = logging.getLogger(__name__)

T = TypeVar("T")


def servers(url: str) -> list[str]:
    """The servers a NATS_URL names: one, or several comma-separated (spaces around them ignored)."""
    return [u.strip() for u in url.split(",") if u.strip()]


async def connect(
    url: str,
    name: str,
    *,
    retry_for: float = 30.0,
    seed_file: str | None = None,
    inbox_prefix: str | None = None,
    ca_file: str | None = None,
    on_closed: Callable[[str], None] | None = None,
) -> NATS:
    """Connect, waiting up to `retry_for` seconds for the broker to come up; reconnect forever after.

    The broker ends a connection for good on a protocol error (nats-py then closes it rather than
    reconnect); `on_closed` is called with the reason when that happens, not when the caller closes it.

    `seed_file` is the identity's nkey seed (deploy/identities.py); `inbox_prefix` its private inbox, the
    only one its permissions let it read replies on; `ca_file` the CA that signed the server's certificate
    (the connection then uses TLS). (nats-py retries a first connection forever when reconnects are
    unlimited, so the wait is bounded here.) `url` may name several servers, comma-separated (the nodes
    of a cluster, `make run HA=1`): the client connects to one and moves to another when it goes.
    """
    last_error: list[Exception] = []

    denials = Denials()

    async def on_error(e: Exception) -> None:
        if denials.note(e):
            log.warning("%s: %s", name, e)
            return
        if not (last_error and "Authorization" in str(last_error[0])):  # the reason that matters most
            last_error[:] = [e]
        log.warning("%s: nats error: %s", name, e)

    connected: list[NATS] = []

    async def on_disconnect() -> None:
        if connected and connected[0].is_closed:  # closed on purpose: nothing to warn about
            return
        log.warning("%s: disconnected from nats", name)

    async def on_reconnect() -> None:
        log.info("%s: reconnected to nats", name)

    async def on_close() -> None:
        nc = connected[0] if connected else None
        if on_closed is not None and nc is not None and nc.last_error is not None:
            on_closed(f"the broker closed the connection: {nc.last_error}")

    options: dict[str, Any] = {}
    if seed_file:
        options["nkeys_seed"] = seed_file
    if inbox_prefix:
        options["inbox_prefix"] = inbox_prefix
    if ca_file:
        options["tls"] = ssl.create_default_context(cafile=ca_file)
    try:
        async with asyncio.timeout(retry_for):
            nc = await nats.connect(
                servers(url),
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                connect_timeout=2,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                closed_cb=on_close,
                **options,
            )
    except (TimeoutError, OSError, nats.errors.Error) as e:
        why = last_error[0] if last_error else e
        if "Authorization" in str(why):
            whose = "a credential it does not accept" if seed_file else "no credential"
            raise ConnectionError(
                f"nats at {url} refused the connection (Authorization Violation): {whose} "
                "(docs/security.md: rackctl takes its credential from a context)"
            ) from None
        raise ConnectionError(f"cannot reach nats at {url} within {retry_for:g}s: {why}") from None
    DENIALS[nc] = denials
    connected.append(nc)
    return nc


class Denials:
    """The broker's "Permissions Violation" errors on one connection, so that a request it refused fails
    at once with a clear reason instead of waiting out its timeout."""

    PREFIX = "nats: permissions violation for publish to "

    def __init__(self) -> None:
        self.waiting: dict[str, list[asyncio.Future[str]]] = {}

    def note(self, e: Exception) -> bool:
        text = str(e)
        if "permissions violation" not in text.lower():
            return False
        if text.lower().startswith(self.PREFIX):
            subject = text[len(self.PREFIX) :].strip().strip('"').lower()  # the error comes lowercased
            for f in self.waiting.pop(subject, []):
                if not f.done():
                    f.set_result(text)
        return True

    def watch(self, subject: str) -> asyncio.Future[str]:
        f: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(subject.lower(), []).append(f)
        return f

    def forget(self, subject: str, f: asyncio.Future[str]) -> None:
        if f in (waiting := self.waiting.get(subject.lower(), [])):
            waiting.remove(f)
            if not waiting:
                del self.waiting[subject.lower()]


DENIALS: weakref.WeakKeyDictionary[NATS, Denials] = weakref.WeakKeyDictionary()
"""Each connection's denials, made by `connect` (a connection made elsewhere has none)."""


async def unless_denied(nc: NATS, subject: str, call: Awaitable[T]) -> T:
    """`call`, a request sent on `subject` (a JetStream API call, say), or a `forbidden` CommandError as
    soon as the broker says this client may not send there, instead of a timeout."""
    denials = DENIALS.get(nc)
    return await call if denials is None else await _unless_denied(call, subject, denials)


async def _unless_denied(call: Awaitable[T], subject: str, denials: Denials) -> T:
    """The reply, or a `forbidden` CommandError as soon as the broker says this client may not send there."""
    denied = denials.watch(subject)
    task = asyncio.ensure_future(call)
    try:
        await asyncio.wait({task, denied}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise CommandError(
                "forbidden", f"forbidden by the broker: this identity may not send on {subject}"
            )
        return task.result()
    finally:
        denials.forget(subject, denied)
        if not task.done():
            task.cancel()
