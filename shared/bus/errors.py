"""What the bus raises, and what handlers raise to tell the bus what to do with a message."""

from __future__ import annotations

import random
import re

RETRY_AFTER = re.compile(r"\bretry after (\d+) ms\b")
RETRIED = ("limited", "busy")
"""Refusals that say when to come back: a command past its silo's or identity's rate (`limited`), or one
instance-manager has no room for yet (`busy`); neither did anything, so sending it again is safe."""
JITTER = 0.5
"""A retry waits the time it was told plus up to this fraction more, at random: callers refused together
do not all come back in the same millisecond."""


class CommandError(Exception):
    """A command that was understood and refused: the reply says why, in one line."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class NotFound(CommandError):
    def __init__(self, message: str) -> None:
        super().__init__("not_found", message)


class Conflict(CommandError):
    def __init__(self, message: str) -> None:
        super().__init__("conflict", message)


class NoReply(CommandError):
    """No reply came (none within the timeout, no service subscribed, or the connection was lost while
    the request was out): the command may or may not have run. The caller may send it again with the same
    envelope id, which the services recognise (`REQUEST`), so that it takes effect once."""


class Reject(Exception):
    """Raised by a stream handler for a message that must never be applied (a forgery, or a claim its
    sender may not make): it is dead-lettered at once with the reason, and nothing it carried is applied."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Retry(Exception):
    """Raised by a stream handler when the message cannot be applied yet (it is redelivered later)."""

    def __init__(self, reason: str, delay: float = 0.5) -> None:
        super().__init__(reason)
        self.delay = delay


class PublishFailed(Exception):
    """JetStream refused a message of a bulk publish (or no stream takes its subject)."""


class FetchFailed(Exception):
    """The broker ended a pull with an error (no such consumer, the consumer deleted): subscribe anew."""


def retry_after(e: CommandError) -> float | None:
    """Seconds to wait before sending a refused command again (jitter included), or None if it is not to
    be sent again."""
    m = RETRY_AFTER.search(e.message) if e.code in RETRIED else None
    return None if m is None else int(m[1]) / 1000 * (1 + random.uniform(0, JITTER))
