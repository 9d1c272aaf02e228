"""Reading a stream's messages one by one, by sequence (`$JS.API.STREAM.MSG.GET`), without a consumer.

The auditor's reads (`rackctl check`, `rackctl dlq`) go this way, so that reading takes no right to create
consumers: a create request that names an existing consumer updates it, filter included, and a reader
granted one could re-point a service's durable (docs/security.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import nats.js.errors
from nats.js import JetStreamContext, api


async def messages(
    js: JetStreamContext, stream: str, subject: str, start: int = 1
) -> AsyncIterator[api.RawStreamMsg]:
    """Every message of `stream` on `subject` (wildcards allowed) from sequence `start`, oldest first, as
    stored when each is read; one round trip each, straight to the next match."""
    seq = start
    while True:
        try:
            raw = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:  # none at or after `seq`
            return
        yield raw
        seq = (raw.seq or seq) + 1
