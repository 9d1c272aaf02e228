"""Reading dead letters, each checked against what its filer may see: one by sequence (`get`), all of them
(`read`, repeats of one filing folded into one), the repeats of one, and how many are recent (`depth`).
Each is read by its sequence, so reading creates no consumer and changes nothing."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext

from rackctl import stored
from rackctl.dead_letters.filers import readers
from rackctl.dead_letters.letters import (
    DLQ,
    GONE,
    MISMATCH,
    NO_MESSAGE,
    OK,
    SEQUENCE,
    UNREAD,
    Check,
    DeadLetter,
    Depth,
    NoDeadLetter,
    api,
    parse,
)
from shared import bus
from shared.topology import jsapi, subjects


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
    if not subjects.matches(letter.subject, reader.filter):
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
            jsapi.stream("MSG.GET", letter.stream),
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
        raw = await api(js, jsapi.stream("MSG.GET", DLQ), js.get_msg(DLQ, seq=seq))
    except nats.js.errors.NotFoundError:
        raise NoDeadLetter(f"no dead letter {seq} (see rackctl dlq list)") from None
    return parse(raw)


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
    info = await api(js, jsapi.stream("INFO", DLQ), js.stream_info(DLQ))
    pattern = subjects.dead_letter(service, ">") if service else subjects.dead_letter("*", ">")
    if not info.state.messages:
        return []
    letters = [parse(raw) async for raw in stored.messages(js, DLQ, pattern, info.state.first_seq or 1)]
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
        d = parse(raw)
        if d.seq != letter.seq and d.original_seq == letter.original_seq:
            if _key(replace(d, check=letter.check)) == key:
                out.append(d.seq)
    return out


async def depth(js: JetStreamContext, within: float) -> Depth:
    """Counted from the newest back to the first older than `within`, so a large old DLQ costs little."""
    info = await js.stream_info(DLQ)
    cutoff = datetime.now(UTC) - timedelta(seconds=within)
    recent, newest = 0, None
    seq = info.state.last_seq
    while info.state.messages and seq >= (info.state.first_seq or 1):
        try:
            letter = parse(await js.get_msg(DLQ, seq=seq))
        except nats.js.errors.NotFoundError:  # deleted (replayed, purged): a gap
            seq -= 1
            continue
        if letter.time < cutoff:
            break
        newest = newest or letter
        recent += 1
        seq -= 1
    return Depth(info.state.messages, recent, within, newest)
