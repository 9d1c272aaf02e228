"""Dead letters: a message that can never be handled is parked with its reason in the DLQ stream, then
its redelivery stopped, so that nothing is lost and the consumer goes on."""

from __future__ import annotations

import logging
import uuid

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared import telemetry
from shared.bus.publish import MSG_ID, wire_size
from shared.bus.wire import settle
from shared.topology import subjects

log = logging.getLogger(__name__)

DLQ_TRUNCATED = "Rp-Dlq-Truncated"
"""Header of a dead letter whose body did not fit beside its headers: the original body's size in bytes
(the letter keeps the body's beginning; it can be read, not replayed)."""


async def dead_letter(
    js: JetStreamContext, msg: Msg, reason: str, *, service: str, stream: str, durable: str, filed_as: str
) -> None:
    """Park `msg` with its reason under `rp.dlq.<service>.<filed_as>`, then stop its redelivery (`term`);
    if the letter cannot be filed, the message is handed back to be tried again.

    Each filing has an id of its own, which no one can guess: an id made from the message (its stream
    and sequence) could be published first by any identity that may file letters, inside the DLQ's
    duplicate window, and the broker would drop the real letter as a repeat; and two consumers giving
    up on one message would keep one letter. A letter filed twice (its `term` lost) is stored twice;
    `rackctl dlq list` shows such repeats as one (rackctl/dead_letters/)."""
    meta = msg.metadata
    headers = {
        MSG_ID: f"dlq:{uuid.uuid4()}",
        "Rp-Dlq-Reason": reason[:1000],
        "Rp-Dlq-Subject": msg.subject,
        "Rp-Dlq-Stream": stream,
        "Rp-Dlq-Sequence": str(meta.sequence.stream),
        "Rp-Dlq-Consumer": durable,
    }
    data = msg.data or b""
    limit = js._nc.max_payload  # the broker's, from its INFO
    if wire_size(data, headers) > limit:  # a body near the limit, which the headers push over it
        headers[DLQ_TRUNCATED] = str(len(data))
        data = data[: max(0, limit - wire_size(b"", headers))]
    try:
        await js.publish(subjects.dead_letter(service, filed_as), data, headers=headers)
    except Exception as e:
        log.warning("%s/%s: dead-letter failed (%s); will retry", service, durable, e)
        await settle(msg.nak(delay=1.0))
        return
    log.warning("%s/%s: dead-lettered %s: %s", service, durable, msg.subject, reason)
    telemetry.count("dead_lettered", consumer=durable)
    await settle(msg.term())
