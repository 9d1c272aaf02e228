"""Subscribers: services that follow rackplane's events (billing, a dashboard, a tenant's automation), each
with an identity and a stream of its own.

A subscriber is a NATS user of the subscribers' account (deploy/identities.py, `SUBSCRIBERS`); the broker
sources into its stream, `EVENTS-<name>`, the events of its scope (the whole fleet's, or one silo's) from
EVENTS, and every consumer on that stream is its own (docs/subjects.md, "Following the events"). Adding,
rotating or removing one changes the broker's config, which it reads again on a reload; the stream is
made and deleted by the subscriber administrator. `rackctl subscriber ...` runs these on the host that
holds the identities folder; tests run them on their stacks.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from deploy import identities, streams
from shared import bus
from shared.topology import subjects

T = TypeVar("T")
RELOADED_WITHIN = 10.0
"""Seconds a reload has to take effect (the subscriber administrator's new grants) before `add` gives up."""


@dataclass
class Rack:
    """Where a rack's identities live, its broker, and how that broker is told to read its config again."""

    store: identities.Store
    url: str
    ca: str | None
    reload: Callable[[], None]
    replicas: int | None = None
    """Copies of each subscriber's stream (None: RACKPLANE_STREAM_REPLICAS), as many as rackplane's."""


def reload_by_pid_file(pid_file: Path) -> Callable[[], None]:
    """What `nats-server --signal reload` does: SIGHUP to the server whose pid the file holds; without that
    file, to every node of a cluster whose pid files are one folder below it (`make run HA=1`:
    nats/n1/nats.pid...)."""

    def reload() -> None:
        files = [pid_file] if pid_file.exists() else sorted(pid_file.parent.glob(f"*/{pid_file.name}"))
        try:
            pids = [int(f.read_text().strip()) for f in files] or [int(pid_file.read_text().strip())]
        except (OSError, ValueError):
            raise RuntimeError(
                f"no running broker found ({pid_file} is missing or unreadable): reload yours "
                "(nats-server --signal reload) and run the command again"
            ) from None
        for pid in pids:
            try:
                os.kill(pid, signal.SIGHUP)
            except ProcessLookupError:
                if len(pids) == 1:
                    raise
                # a cluster node that is down: it reads the config when it starts again

    return reload


def subscriber_of(store: identities.Store, name: str) -> identities.Identity:
    identity = store.identities.get(name)
    if identity is None or identity.kind != "subscriber":
        raise LookupError(f"no subscriber {name!r} (rackctl subscriber list)")
    return identity


def scope(identity: identities.Identity) -> str | None:
    """The silo a subscriber follows, or None for the whole fleet."""
    return identity.param or None


async def _as_admin(rack: Rack, call: Callable[[JetStreamContext], Awaitable[T]]) -> T:
    """`call` with the subscriber administrator's connection; a refusal right after a reload (the broker
    not yet granting a new stream's name) is tried again for RELOADED_WITHIN seconds."""
    nc = await bus.connect(
        rack.url,
        identities.SUBSCRIBER_ADMIN,
        retry_for=5.0,
        seed_file=str(rack.store.seed_file(identities.SUBSCRIBER_ADMIN)),
        inbox_prefix=subjects.inbox_prefix(identities.SUBSCRIBER_ADMIN),
        ca_file=rack.ca,
    )
    deadline = asyncio.get_running_loop().time() + RELOADED_WITHIN
    try:
        while True:
            try:
                async with asyncio.timeout(5.0):
                    return await call(nc.jetstream())
            except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(
                        "the broker did not answer the subscriber administrator: was it reloaded?"
                    ) from None
                await asyncio.sleep(0.3)
    finally:
        await nc.close()


async def add(rack: Rack, name: str, silo: str | None = None) -> identities.Identity:
    """A new subscriber, or one made before completed (its stream made): the same name with another scope
    is refused, as is a name another identity has."""
    wanted = identities.subscriber(name, silo)
    existing = rack.store.identities.get(name)
    if existing is not None and existing != wanted:
        of = existing.param or "the fleet"
        what = f"a subscriber of {of}" if existing.kind == "subscriber" else "taken"
        raise ValueError(f"{name!r} is {what}: remove it first, or pick another name")
    if existing is None:
        rack.store.add(wanted)
        rack.reload()
    await _as_admin(rack, lambda js: streams.ensure_subscriber_stream(js, name, silo, rack.replicas))
    return wanted


async def remove(rack: Rack, name: str) -> None:
    """The subscriber's stream deleted, then its identity: its key refused once the broker reloads."""
    subscriber_of(rack.store, name)

    async def delete(js: JetStreamContext) -> None:
        try:
            await js.delete_stream(subjects.subscriber_stream(name))
        except nats.js.errors.NotFoundError:
            pass

    await _as_admin(rack, delete)
    rack.store.remove(name)
    rack.reload()


def rotate(rack: Rack, name: str) -> Path:
    """A new key for the subscriber (the same seed file): the old one is refused once the broker reloads."""
    subscriber_of(rack.store, name)
    path = rack.store.rotate(name)
    rack.reload()
    return path


async def describe(rack: Rack) -> list[dict[str, Any]]:
    """Every subscriber: its scope, its stream, and what that stream holds (None where the broker does not
    say)."""
    subs = sorted(rack.store.subscribers(), key=lambda i: i.name)

    async def infos(js: JetStreamContext) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for s in subs:
            try:
                out[s.name] = await js.stream_info(subjects.subscriber_stream(s.name))
            except nats.js.errors.NotFoundError:
                out[s.name] = None
        return out

    try:
        found = await _as_admin(rack, infos) if subs else {}
    except (RuntimeError, OSError, nats.errors.Error):
        found = {}
    rows = []
    for s in subs:
        info = found.get(s.name)
        rows.append(
            {
                "name": s.name,
                "silo": scope(s),
                "stream": subjects.subscriber_stream(s.name),
                "events": info.state.messages if info else None,
                "consumers": info.state.consumer_count if info else None,
            }
        )
    return rows


async def ensure_all(url: str, folder: Path, ca: str | None) -> list[str]:
    """Every subscriber's stream the identities folder names, made where missing (compose's `streams` step,
    after rackplane's own): the broker already knows the subscribers, so no reload."""
    rack = Rack(identities.Store.load(folder), url, ca, lambda: None)
    names = [s.name for s in rack.store.subscribers()]
    for s in rack.store.subscribers():
        await add(rack, s.name, scope(s))
    return names


def main() -> None:
    """`python -m deploy.subscribers DIR`: the subscribers' streams, with NATS_URL and NATS_CA_FILE."""
    import sys

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m deploy.subscribers IDENTITIES_DIR  (with NATS_URL, NATS_CA_FILE)")
    url = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
    names = asyncio.run(ensure_all(url, Path(sys.argv[1]), os.environ.get("NATS_CA_FILE") or None))
    print(f"subscribers' streams in place: {', '.join(names) or 'none'}")


if __name__ == "__main__":
    main()
