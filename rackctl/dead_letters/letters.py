"""A dead letter as stored in the DLQ stream: its headers (`Rp-Dlq-*`, its filer's word), what its check
says, and the parsing of one stored message into a `DeadLetter`; the errors of reading them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nats.js import JetStreamContext

from rackctl.dead_letters.filers import sled_of
from shared import bus
from shared.topology import subjects

DLQ = subjects.DLQ_STREAM
REASON, SUBJECT, STREAM, SEQUENCE, CONSUMER = (
    "Rp-Dlq-Reason",
    "Rp-Dlq-Subject",
    "Rp-Dlq-Stream",
    "Rp-Dlq-Sequence",
    "Rp-Dlq-Consumer",
)
REPLAY_OF = "Rp-Replay-Of"
"""Header of a replayed message: the dead letter it was (`DLQ:<seq>`), for whoever traces it later."""

NO_MESSAGE = (10043, 10057)
"""The broker's error codes for a message it does not hold (`sequence N not found`, with
status 400; `no message found`, with status 500), rather than a 404."""


OK, GONE, MISMATCH, UNREAD = "ok", "gone", "MISMATCH", "unread"
"""What a letter's check says: its claims hold and its original is stored as claimed; its claims hold
and its original has left its stream; a claim does not hold (a forgery, or a filer's bug); the original
could not be read (this identity may not)."""


@dataclass(frozen=True)
class Check:
    status: str
    reason: str = ""
    """One line: why the letter is not `ok`."""
    original: bytes | None = field(default=None, repr=False)
    """The original message's body, as its stream holds it (when `ok`)."""


@dataclass(frozen=True)
class DeadLetter:
    seq: int
    time: datetime
    service: str
    consumer: str
    """The consumer that gave up, as the letter claims (`Rp-Dlq-Consumer`: `accounting-deltas-2` say)."""
    reason: str
    subject: str
    """The original subject, as stored (`Rp-Dlq-Subject`)."""
    stream: str
    original_seq: int | None
    data: bytes = field(repr=False)
    headers: dict[str, str] = field(repr=False)
    filed_on: str = ""
    """The DLQ subject it was published on: the one thing about it the broker vouches for."""
    check: Check | None = None
    repeats: tuple[int, ...] = ()
    """Later letters of the same filer about the same stored message, with the same body."""

    @property
    def replay_to(self) -> str:
        return subjects.replay_subject(self.subject)

    @property
    def filed_by(self) -> str:
        """Who filed it, by its DLQ subject: a sled for `rp.dlq.sled-agent.sled-agent-<sled>` (or the
        simulator, which holds every sled's credential), else the service."""
        sled = sled_of(self.filed_on)
        return sled or self.service

    def payload(self) -> Any:
        """The message as JSON when it is JSON, else as text (a malformed message is kept as it came)."""
        try:
            return json.loads(self.data)
        except ValueError:
            return self.data.decode(errors="replace")

    def as_dict(self, payload: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "seq": self.seq,
            "time": self.time.isoformat(),
            "service": self.service,
            "filed_by": self.filed_by,
            "filed_on": self.filed_on,
            "consumer": self.consumer,
            "reason": self.reason,
            "subject": self.subject,
            "stream": self.stream,
            "original_seq": self.original_seq,
            "replay_to": self.replay_to,
            "check": self.check.status if self.check else None,
            "check_reason": self.check.reason if self.check else None,
            "repeats": list(self.repeats),
        }
        if payload:
            d["headers"] = self.headers
            d["payload"] = self.payload()
        return d


class NoDeadLetter(LookupError):
    """No dead letter at that sequence (never was, or deleted, replayed or aged out)."""


def parse(raw: Any) -> DeadLetter:
    h = {k: str(v) for k, v in (raw.headers or {}).items()}
    service, consumer = subjects.parse_dead_letter(raw.subject or "") or ("?", "?")
    seq = h.get(SEQUENCE, "")
    return DeadLetter(
        seq=raw.seq,
        time=raw.time or datetime.fromtimestamp(0, UTC),
        service=service,
        consumer=h.get(CONSUMER) or consumer,
        reason=h.get(REASON, ""),
        subject=h.get(SUBJECT, ""),
        stream=h.get(STREAM, ""),
        original_seq=int(seq) if seq.isdigit() else None,
        data=raw.data or b"",
        headers=h,
        filed_on=raw.subject or "",
    )


@dataclass(frozen=True)
class Depth:
    """How many dead letters the DLQ holds, and how many are younger than `within` seconds: the gauge
    `rackctl check` reports (the services count theirs as they make them: `<durable>.dead_lettered`)."""

    total: int
    recent: int
    within: float
    newest: DeadLetter | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "recent": self.recent,
            "within_seconds": self.within,
            "newest": self.newest.as_dict() if self.newest else None,
        }


async def api(js: JetStreamContext, subject: str, call: Any) -> Any:
    """A JetStream call that fails at once, with a clear line, when this identity may not make it."""
    try:
        return await bus.unless_denied(js._nc, subject, call)
    except bus.CommandError as e:
        if e.code == "forbidden":
            raise bus.CommandError(
                "forbidden",
                f"{e.message} (reading dead letters takes the auditor's rights; replaying and deleting them "
                "the dlq-admin identity's: --context dlq-admin)",
            ) from None
        raise
