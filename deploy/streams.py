"""The JetStream streams, created or brought up to date by deploy with the stream-administrator identity.

No service holds stream-management rights (deploy/identities.py): `make run` (deploy/stack.py) and the
compose init step (`python -m deploy.streams`) run this before the services start.

    python -m deploy.streams    # with NATS_URL, NATS_NKEY_FILE (stream-admin's seed), NATS_CA_FILE
"""

from __future__ import annotations

import asyncio

import nats.js.errors
from nats.js import JetStreamContext, api

from shared import bus
from shared.config import ConfigError, Settings
from shared.topology import subjects

MAX_AGE_S = 7 * 24 * 3600.0
MAX_CONSUMERS = 100_000
"""Consumers a stream may hold. nats-server 2.15 gives a stream that sets none a limit of 1,000 (and reads 0
or -1 as "the default", not "unlimited"), and the sleds' command stream holds a durable consumer for
each sled: past 1,000 sleds the rest could not read their orders (`maximum consumers limit reached`)."""


TTL_STREAMS = {subjects.SLED_REPORT_STREAM}
"""Streams whose messages may say how long they are kept (`Nats-TTL`): a sled's inventory is superseded by
its next, and kept for `Settings.inventory_keep()` rather than the stream's week (at 5,000 sleds every
5 s, a week of inventories is some 600 million messages); VMM reports beside them are kept as long as the
stream keeps anything. An existing stream is updated to allow them; a stream cannot be set back."""


def configs(window: float | None = None, replicas: int | None = None) -> list[api.StreamConfig]:
    """Every stream; `window` is the duplicate window (RACKPLANE_DUPLICATE_WINDOW when not given), and
    `replicas` the copies a cluster keeps of each (RACKPLANE_STREAM_REPLICAS when not given: 3 on the
    three-node cluster of `make run HA=1`, so that a stream outlives the loss of any one node)."""
    if window is None or replicas is None:
        s = Settings.from_env()
        window = s.duplicate_window if window is None else window
        replicas = s.stream_replicas if replicas is None else replicas
    return [
        api.StreamConfig(
            name=name,
            subjects=subs,
            storage=api.StorageType.FILE,
            retention=api.RetentionPolicy.LIMITS,
            duplicate_window=window,
            max_age=MAX_AGE_S,
            max_consumers=MAX_CONSUMERS,
            allow_msg_ttl=name in TTL_STREAMS,
            num_replicas=replicas,
            subject_transform=(
                api.SubjectTransform(src=t[0], dest=t[1]) if (t := subjects.TRANSFORMS.get(name)) else None
            ),
        )
        for name, subs in subjects.STREAMS.items()
    ]


def subscriber_config(name: str, silo: str | None, replicas: int | None = None) -> api.StreamConfig:
    """A subscriber's own stream, in the subscribers' account: the broker sources into it, from EVENTS in
    rackplane's account, the events of its scope (all, or `rp.evt.<silo>.>`), from the oldest EVENTS still
    keeps; it keeps them as long as EVENTS does. Its sequences are its own; each message keeps its subject
    and headers (`Nats-Msg-Id`, the dedupe key) and says where it came from (`Nats-Stream-Source`). It
    has as many replicas as rackplane's streams (`replicas`, else RACKPLANE_STREAM_REPLICAS)."""
    return api.StreamConfig(
        name=subjects.subscriber_stream(name),
        num_replicas=Settings.from_env().stream_replicas if replicas is None else replicas,
        storage=api.StorageType.FILE,
        retention=api.RetentionPolicy.LIMITS,
        max_age=MAX_AGE_S,
        max_consumers=MAX_CONSUMERS,
        sources=[
            api.StreamSource(
                name=subjects.EVENTS_STREAM,
                filter_subject=subjects.event_pattern(silo),
                external=api.ExternalStream(
                    api=subjects.SUBSCRIBERS_API, deliver=subjects.subscriber_delivery(name)
                ),
            )
        ],
    )


async def ensure_subscriber_stream(
    js: JetStreamContext, name: str, silo: str | None, replicas: int | None = None
) -> None:
    """Make a subscriber's stream (as the subscriber administrator); one already made is left as it is:
    the administrator may not update one (deploy/identities.py), so its replicas are those it was made
    with."""
    await js.add_stream(subscriber_config(name, silo, replicas))


async def ensure_streams(
    js: JetStreamContext, window: float | None = None, replicas: int | None = None
) -> None:
    """Each stream added, or, where it exists with another config (a duplicate window, a replica count),
    updated to this one: in a cluster nats-server moves a stream to more replicas in place."""
    for config in configs(window, replicas):
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError as refused:
            try:
                await js.update_stream(config)
            except nats.js.errors.NotFoundError:  # not there: the add's own reason is the one to show
                raise refused from None


async def ensure(
    url: str,
    seed_file: str | None,
    ca_file: str | None = None,
    *,
    retry_for: float = 30.0,
    window: float | None = None,
    replicas: int | None = None,
) -> None:
    """Connect as the stream administrator and put the streams in place."""
    nc = await bus.connect(
        url,
        "stream-admin",
        retry_for=retry_for,
        seed_file=seed_file,
        inbox_prefix=subjects.inbox_prefix("stream-admin"),
        ca_file=ca_file,
    )
    try:
        await ensure_streams(nc.jetstream(), window, replicas)
    finally:
        await nc.close()


def main() -> None:
    try:
        s = Settings.from_env()
    except ConfigError as e:
        raise SystemExit(f"streams: {e}") from None
    asyncio.run(ensure(s.nats_url, s.nats_nkey_file, s.nats_ca_file))
    print(f"streams in place: {', '.join(subjects.STREAMS)}")


if __name__ == "__main__":
    main()
