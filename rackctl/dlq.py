"""Dead letters (stream DLQ): read them, replay them to where they came from, delete them.

Each is read by its sequence (`$JS.API.STREAM.MSG.GET.DLQ`), so reading creates no consumer and changes
nothing. A replay publishes the message's bytes, unchanged, on the subject it was first published on
(`subjects.replay_subject`), under a message id of its own (`replay:DLQ:<seq>`: the original's id may
still be inside the broker's duplicate window, and a replay retried within it is stored once), then deletes
the dead letter. The consumer takes it as any message: decoded, checked against its subject and fenced
again, so a replay can never get past a check that an original could not. If it fails again, it is
dead-lettered again, with a new sequence and its new reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext

from rackctl import stored
from shared import bus, subjects

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


@dataclass(frozen=True)
class DeadLetter:
    seq: int
    time: datetime
    service: str
    consumer: str
    """The consumer that gave up (`Rp-Dlq-Consumer`: the durable, `accounting-deltas-2` say)."""
    reason: str
    subject: str
    """The original subject, as stored (`Rp-Dlq-Subject`)."""
    stream: str
    original_seq: int | None
    data: bytes = field(repr=False)
    headers: dict[str, str] = field(repr=False)

    @property
    def replay_to(self) -> str:
        return subjects.replay_subject(self.subject)

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
            "consumer": self.consumer,
            "reason": self.reason,
            "subject": self.subject,
            "stream": self.stream,
            "original_seq": self.original_seq,
            "replay_to": self.replay_to,
        }
        if payload:
            d["headers"] = self.headers
            d["payload"] = self.payload()
        return d


class NoDeadLetter(LookupError):
    """No dead letter at that sequence (never was, or deleted, replayed or aged out)."""


def _parse(raw: Any) -> DeadLetter:
    h = {k: str(v) for k, v in (raw.headers or {}).items()}
    tokens = (raw.subject or "").split(".")
    seq = h.get(SEQUENCE, "")
    return DeadLetter(
        seq=raw.seq,
        time=raw.time or datetime.fromtimestamp(0, UTC),
        service=tokens[2] if len(tokens) > 2 else "?",
        consumer=h.get(CONSUMER) or (tokens[3] if len(tokens) > 3 else "?"),
        reason=h.get(REASON, ""),
        subject=h.get(SUBJECT, ""),
        stream=h.get(STREAM, ""),
        original_seq=int(seq) if seq.isdigit() else None,
        data=raw.data or b"",
        headers=h,
    )


async def get(js: JetStreamContext, seq: int) -> DeadLetter:
    try:
        raw = await _api(js, f"$JS.API.STREAM.MSG.GET.{DLQ}", js.get_msg(DLQ, seq=seq))
    except nats.js.errors.NotFoundError:
        raise NoDeadLetter(f"no dead letter {seq} (see rackctl dlq list)") from None
    return _parse(raw)


async def read(
    js: JetStreamContext, *, service: str | None = None, since: datetime | None = None
) -> list[DeadLetter]:
    """Every dead letter (of `service`, and stored at or after `since`), oldest first."""
    info = await _api(js, f"$JS.API.STREAM.INFO.{DLQ}", js.stream_info(DLQ))
    pattern = subjects.dead_letter(service, ">") if service else subjects.dead_letter("*", ">")
    if not info.state.messages:
        return []
    letters = [_parse(raw) async for raw in stored.messages(js, DLQ, pattern, info.state.first_seq or 1)]
    return [d for d in letters if since is None or d.time >= since]


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


async def depth(js: JetStreamContext, within: float) -> Depth:
    """Counted from the newest back to the first older than `within`, so a large old DLQ costs little."""
    info = await js.stream_info(DLQ)
    cutoff = datetime.now(UTC) - timedelta(seconds=within)
    recent, newest = 0, None
    seq = info.state.last_seq
    while info.state.messages and seq >= (info.state.first_seq or 1):
        try:
            letter = _parse(await js.get_msg(DLQ, seq=seq))
        except nats.js.errors.NotFoundError:  # deleted (replayed, purged): a gap
            seq -= 1
            continue
        if letter.time < cutoff:
            break
        newest = newest or letter
        recent += 1
        seq -= 1
    return Depth(info.state.messages, recent, within, newest)


async def replay(js: JetStreamContext, seq: int) -> tuple[DeadLetter, int]:
    """Publish dead letter `seq` again where it came from, then delete it: (the letter, the new stream
    sequence of the replayed message)."""
    letter = await get(js, seq)
    target = letter.replay_to
    if not any(_matches(target, p) for p in subjects.REPLAYABLE):
        raise bus.CommandError(
            "invalid", f"dead letter {seq} came from {letter.subject!r}, which no stream of rackplane holds"
        )
    if size := letter.headers.get(bus.DLQ_TRUNCATED):
        raise bus.CommandError(
            "invalid",
            f"dead letter {seq} keeps only the first {len(letter.data)} of its {size} bytes (the whole did "
            "not fit beside its headers under the broker's max payload): it can be read, not replayed",
        )
    headers = {bus.MSG_ID: f"replay:{DLQ}:{seq}", REPLAY_OF: f"{DLQ}:{seq}"}
    ack = await _api(js, target, js.publish(target, letter.data, headers=headers))
    await delete(js, seq)
    return letter, ack.seq


async def delete(js: JetStreamContext, seq: int) -> None:
    try:
        await _api(js, f"$JS.API.STREAM.MSG.DELETE.{DLQ}", js.delete_msg(DLQ, seq))
    except nats.js.errors.NotFoundError:
        raise NoDeadLetter(f"no dead letter {seq} (see rackctl dlq list)") from None


def _matches(subject: str, pattern: str) -> bool:
    s, p = subject.split("."), pattern.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(s) == len(p)


async def _api(js: JetStreamContext, subject: str, call: Any) -> Any:
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
