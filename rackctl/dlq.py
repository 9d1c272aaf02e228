"""Dead letters (stream DLQ): read them, check what they claim, replay the messages they stand for, delete.

Each is read by its sequence (`$JS.API.STREAM.MSG.GET.DLQ`), so reading creates no consumer and changes
nothing.

A letter's headers (`Rp-Dlq-*`) and body are whatever its publisher wrote, and any identity that may file
letters may write any: a sled may publish on its own DLQ subject. The one thing the broker vouches for is
that DLQ subject (`rp.dlq.<service>.<durable or name>`), since each identity may publish only on its own.
So a letter is judged by its filer (`check`): the consumer it names must be one that files on that
subject, by the topology in code (deploy/identities.py's grants, which the broker enforces: a durable is
created on the subject that carries its filter); the stream must be that consumer's and the subject one
its filter takes; and the message at that stream and sequence must be on that subject, with that body.

A replay puts on the bus only what was really stored: the original, read from its stream by sequence,
published on the subject it was first published on (`subjects.replay_subject`), which the filer's
consumer reads. A letter whose claims do not hold is refused, with the reason in one line. A letter
whose original has left its stream (aged out, or an inventory past its TTL) is replayed from its own
body only where every identity that may file it could have published that message itself, else refused:
replaying it would let the filer say what it may not. The replay goes under a message id of its own,
made from the letter's (`replay:DLQ:<seq>:<digest>`, which no one who cannot read the DLQ can guess, so a
replay retried within the duplicate window is stored once and none can be pre-empted), then the letter
and its repeats are deleted. The consumer takes it as any message: decoded, checked against its subject
and fenced again. If it fails again, it is dead-lettered again, with a new sequence and its new reason.

Each filing has an id of its own (shared/bus.py), so a letter filed twice (its `term` lost) is stored
twice: `read` shows such repeats (one filer, one original, one body) as one letter, with their sequences.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext

from deploy import identities
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
        sled = _sled_of(self.filed_on)
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
        filed_on=raw.subject or "",
    )


# --- who files where, and what each consumer reads: the topology in code ---------------------------------


@dataclass(frozen=True)
class Reader:
    """A durable consumer of rackplane's: the stream and filter it reads, the subject it files letters on."""

    stream: str
    durable: str
    filter: str


def _sled_of(filed_on: str) -> str | None:
    """The sled whose own DLQ subject this is (`rp.dlq.sled-agent.sled-agent-<sled>`), or None."""
    tokens = filed_on.split(".")
    if len(tokens) != 4 or tokens[:3] != ["rp", "dlq", "sled-agent"]:
        return None
    sled = tokens[3].removeprefix(subjects.SLED_DURABLE_PREFIX)
    return sled if sled != tokens[3] and identities.SLED_ID.match(sled) else None


def _files_under(durable: str) -> str:
    """The name a durable files its letters under: its own, but accounting's partitions share one."""
    partitions = {subjects.delta_durable(p) for p in range(subjects.DELTA_PARTITIONS)}
    return subjects.DELTA_DEAD_LETTERS if durable in partitions else durable


def _consumers(grants: identities.Grants) -> Iterator[Reader]:
    """The durables a grant lets its holder create, each with the filter the broker holds it to."""
    prefix = "$JS.API.CONSUMER.CREATE."
    for p in grants.publish:
        if p.startswith(prefix) and p.count(".") >= 6:
            stream, durable, filter_subject = p[len(prefix) :].split(".", 2)
            yield Reader(stream, durable, filter_subject)


def readers(filed_on: str) -> list[Reader]:
    """The consumers that file their letters on `filed_on`."""
    tokens = filed_on.split(".")
    if len(tokens) != 4 or tokens[:2] != ["rp", "dlq"]:
        return []
    service = tokens[2]
    if sled := _sled_of(filed_on):
        grants = identities.sled_grants(sled)
    elif service in identities.SERVICES and service != "simulator":
        grants = identities.service_grants(service)
    else:
        return []
    return [
        r for r in _consumers(grants) if subjects.dead_letter(service, _files_under(r.durable)) == filed_on
    ]


def _filers(filed_on: str) -> list[identities.Identity]:
    """Every identity the broker lets publish on `filed_on`."""
    candidates = identities.standard(sleds=0)
    if sled := _sled_of(filed_on):
        candidates.append(identities.sled(sled))
    return [i for i in candidates if _may_publish(i.grants, filed_on)]


def could_publish(filed_on: str, subject: str) -> bool:
    """Whether every identity that may file on `filed_on` may itself publish on `subject`: then replaying
    a letter's own body there lends its filer no right it does not have."""
    filers = _filers(filed_on)
    return bool(filers) and all(_may_publish(i.grants, subject) for i in filers)


def _may_publish(g: identities.Grants, subject: str) -> bool:
    return any(_matches(subject, p) for p in g.publish) and not any(
        _matches(subject, p) for p in g.publish_deny
    )


# --- reading -------------------------------------------------------------------------------------------


async def check(js: JetStreamContext, letter: DeadLetter) -> Check:
    """Whether the letter's claims match what its filer may see, and its original is stored as claimed."""
    rs = readers(letter.filed_on)
    if not rs:
        return Check(MISMATCH, f"filed on {letter.filed_on}, where no consumer of rackplane files")
    reader = next((r for r in rs if r.durable == letter.consumer), None)
    if reader is None:
        names = ", ".join(r.durable for r in rs)
        return Check(
            MISMATCH, f"names consumer {letter.consumer!r}, but {letter.filed_by} files for {names} only"
        )
    if letter.stream != reader.stream:
        return Check(MISMATCH, f"names stream {letter.stream!r}, but {reader.durable} reads {reader.stream}")
    if any(t in ("", "*", ">") for t in letter.subject.split(".")):
        return Check(MISMATCH, f"names {letter.subject!r}, which is no message's subject")
    if not _matches(letter.subject, reader.filter):
        return Check(
            MISMATCH,
            f"names subject {letter.subject!r}, which {reader.durable} does not read (its filter is "
            f"{reader.filter})",
        )
    if letter.original_seq is None or not 0 < letter.original_seq < 2**63:
        return Check(MISMATCH, f"names no stream sequence ({letter.headers.get(SEQUENCE)!r})")
    where = f"{letter.stream} {letter.original_seq}"
    try:
        original = await bus.unless_denied(
            js._nc,
            f"$JS.API.STREAM.MSG.GET.{letter.stream}",
            js.get_msg(letter.stream, seq=letter.original_seq),
        )
    except nats.js.errors.APIError as e:
        if isinstance(e, nats.js.errors.NotFoundError) or e.err_code in NO_MESSAGE:
            return Check(GONE, f"its original ({where}) has left its stream")
        return Check(MISMATCH, f"names {where}, which the broker does not read: {e.description}")
    except (bus.CommandError, TimeoutError) as e:
        why = e.message if isinstance(e, bus.CommandError) else "no answer"
        return Check(UNREAD, f"its original ({where}) was not read: {why}")
    if original.subject != letter.subject:
        return Check(MISMATCH, f"names subject {letter.subject!r}, but {where} is on {original.subject}")
    data = original.data or b""
    size = letter.headers.get(bus.DLQ_TRUNCATED)
    whole = data.startswith(letter.data) and size == str(len(data)) if size else data == letter.data
    if not whole:
        return Check(MISMATCH, f"its body is not that of {where}")
    return Check(OK, original=data)


async def get(js: JetStreamContext, seq: int) -> DeadLetter:
    """Dead letter `seq`, checked."""
    letter = await _get(js, seq)
    return replace(letter, check=await check(js, letter))


async def _get(js: JetStreamContext, seq: int) -> DeadLetter:
    try:
        raw = await _api(js, f"$JS.API.STREAM.MSG.GET.{DLQ}", js.get_msg(DLQ, seq=seq))
    except nats.js.errors.NotFoundError:
        raise NoDeadLetter(f"no dead letter {seq} (see rackctl dlq list)") from None
    return _parse(raw)


async def read(
    js: JetStreamContext,
    *,
    service: str | None = None,
    since: datetime | None = None,
    repeats: bool = False,
) -> list[DeadLetter]:
    """Every dead letter (of `service`, and stored at or after `since`), oldest first, each checked; the
    repeats of one (same filer, same original, same body: a filing whose `term` was lost) shown as one,
    the oldest, unless `repeats`. A letter whose claims do not hold is never folded into another."""
    info = await _api(js, f"$JS.API.STREAM.INFO.{DLQ}", js.stream_info(DLQ))
    pattern = subjects.dead_letter(service, ">") if service else subjects.dead_letter("*", ">")
    if not info.state.messages:
        return []
    letters = [_parse(raw) async for raw in stored.messages(js, DLQ, pattern, info.state.first_seq or 1)]
    letters = [replace(d, check=await check(js, d)) for d in letters if since is None or d.time >= since]
    return letters if repeats else _fold(letters)


def _key(d: DeadLetter) -> tuple[Any, ...] | None:
    """What makes two letters repeats of one filing; None for a letter whose claims do not hold."""
    if d.check is None or d.check.status not in (OK, GONE):
        return None
    return (d.filed_on, d.consumer, d.stream, d.original_seq, d.subject, hashlib.sha256(d.data).digest())


def _fold(letters: list[DeadLetter]) -> list[DeadLetter]:
    first: dict[tuple[Any, ...], int] = {}
    out: list[DeadLetter] = []
    for d in letters:
        key = _key(d)
        if key is not None and key in first:
            i = first[key]
            out[i] = replace(out[i], repeats=(*out[i].repeats, d.seq))
            continue
        if key is not None:
            first[key] = len(out)
        out.append(d)
    return out


async def repeats_of(js: JetStreamContext, letter: DeadLetter) -> list[int]:
    """The sequences of the letters that repeat `letter` (its filer's, about the same original)."""
    key = _key(letter)
    if key is None:
        return []
    out = []
    async for raw in stored.messages(js, DLQ, letter.filed_on):
        d = _parse(raw)
        if d.seq != letter.seq and d.original_seq == letter.original_seq:
            if _key(replace(d, check=letter.check)) == key:
                out.append(d.seq)
    return out


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


# --- replaying and deleting ------------------------------------------------------------------------------


class Refused(bus.CommandError):
    """A replay refused: the letter's claims do not hold, or what it stands for cannot be published."""

    def __init__(self, message: str) -> None:
        super().__init__("refused", message)


async def replay(js: JetStreamContext, seq: int) -> tuple[DeadLetter, int]:
    """Publish the message dead letter `seq` stands for where it came from, then delete the letter and
    its repeats: (the letter, the new stream sequence of the replayed message)."""
    letter = await get(js, seq)
    checked = letter.check or Check(UNREAD)
    target = letter.replay_to
    if checked.status == MISMATCH:
        raise Refused(f"dead letter {seq} (filed by {letter.filed_by}) is not replayed: it {checked.reason}")
    if checked.status == UNREAD:
        raise bus.CommandError("forbidden", f"dead letter {seq} is not replayed: {checked.reason}")
    if not any(_matches(target, p) for p in subjects.REPLAYABLE):
        raise Refused(f"dead letter {seq} came from {letter.subject!r}, which no stream of rackplane holds")
    if checked.status == GONE:
        if size := letter.headers.get(bus.DLQ_TRUNCATED):
            raise Refused(
                f"dead letter {seq}: {checked.reason}, and the letter keeps only the first "
                f"{len(letter.data)} of its {size} bytes: it can be read, not replayed"
            )
        if not could_publish(letter.filed_on, target):
            raise Refused(
                f"dead letter {seq}: {checked.reason}, and {letter.filed_by} may not publish on {target} "
                "itself, so its letter's body is not sent there: it can be read, not replayed"
            )
        data = letter.data
    else:
        data = checked.original or b""
    headers = {bus.MSG_ID: replay_id(letter), REPLAY_OF: f"{DLQ}:{seq}"}
    if bus.wire_size(data, headers) > js._nc.max_payload:
        raise Refused(
            f"dead letter {seq}: its message ({len(data)} bytes) and a replay's headers would pass the "
            "broker's max payload: it can be read, not replayed"
        )
    ack = await _api(js, target, js.publish(target, data, headers=headers))
    for s in [seq, *await repeats_of(js, letter)]:
        try:
            await delete(js, s)
        except NoDeadLetter:  # a repeat deleted meanwhile
            pass
    return letter, ack.seq


def replay_id(letter: DeadLetter) -> str:
    """The replay's message id: the same for every try of one letter's replay (so a retry within the
    duplicate window is stored once), and made from the letter's own random id and time, which only
    the DLQ's readers know (so no publisher on the target stream can take it first)."""
    seed = f"{letter.headers.get(bus.MSG_ID, '')}|{letter.time.isoformat()}|{letter.seq}"
    return f"replay:{DLQ}:{letter.seq}:{hashlib.sha256(seed.encode()).hexdigest()[:16]}"


async def delete(js: JetStreamContext, seq: int) -> None:
    try:
        await _api(js, f"$JS.API.STREAM.MSG.DELETE.{DLQ}", js.delete_msg(DLQ, seq))
    except nats.js.errors.APIError as e:
        if isinstance(e, nats.js.errors.NotFoundError) or e.err_code in NO_MESSAGE:
            raise NoDeadLetter(f"no dead letter {seq} (see rackctl dlq list)") from None
        raise


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
