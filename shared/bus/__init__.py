"""NATS and JetStream, the way every service uses them.

- `connect` (connect.py): a connection that reconnects forever, with the client's own credential, its
  private reply inbox and TLS; the broker's permission denials on it (`unless_denied`).
- `publish` (publish.py): one envelope into JetStream, with `Nats-Msg-Id` (the broker drops repeats
  inside its window) and the trace context in headers; `BulkPublisher`: many at once, one wait for all
  their acks (the outbox relay's way).
- `Consumer` (consume.py, fetching through pull.py's `Pull`): a durable pull consumer with one loop and a
  batch handler (a handler of single messages is one of batches of one), that acks only after its
  handler returned (so after the handler's transaction committed), hands back what cannot be applied yet,
  and dead-letters what it can never handle, with the reason (deadletter.py).
- `serve` / `request` (rpc.py): operator commands as request/reply, with errors as clear replies.
- wire.py: where the bus touches the broker, each a plain call; fault injection (shared/faults.py)
  installs wrappers there when a process starts with RACKPLANE_FAULTS, and nowhere else.
"""

from shared.bus.connect import Denials, connect, servers, unless_denied
from shared.bus.consume import BatchHandler, Consumer, Delivery, Handler, each
from shared.bus.deadletter import DLQ_TRUNCATED, dead_letter
from shared.bus.errors import (
    JITTER,
    CommandError,
    Conflict,
    FetchFailed,
    NoReply,
    NotFound,
    PublishFailed,
    Reject,
    Retry,
    retry_after,
)
from shared.bus.publish import (
    MSG_ID,
    TTL_HEADER,
    BulkPublisher,
    headers_for,
    msg_id_for,
    publish,
    wire_size,
)
from shared.bus.pull import Pull
from shared.bus.rpc import REQUEST, CommandHandler, request, request_digest, serve, stop_serving

__all__ = [
    "DLQ_TRUNCATED",
    "JITTER",
    "MSG_ID",
    "REQUEST",
    "TTL_HEADER",
    "BatchHandler",
    "BulkPublisher",
    "CommandError",
    "CommandHandler",
    "Conflict",
    "Consumer",
    "Delivery",
    "Denials",
    "FetchFailed",
    "Handler",
    "NoReply",
    "NotFound",
    "PublishFailed",
    "Pull",
    "Reject",
    "Retry",
    "connect",
    "dead_letter",
    "each",
    "headers_for",
    "msg_id_for",
    "publish",
    "request",
    "request_digest",
    "retry_after",
    "serve",
    "servers",
    "stop_serving",
    "unless_denied",
    "wire_size",
]
