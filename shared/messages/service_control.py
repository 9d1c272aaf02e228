"""What every service answers on rp.svc.<service>.*: its counters (stats) and the faults it injects
into its own messages (request/reply).

Apart from the domain schemas because every service takes them alike; shared/faults.py carries out what
`ServiceFaults` sets.
"""

from __future__ import annotations

from pydantic import model_validator

from shared.messages.base import (
    Copies,
    HandlerDelaySeconds,
    HeldAcks,
    HoldSeconds,
    Model,
    Probability,
    ReorderHoldSeconds,
    ReorderWindow,
    SubjectPrefixes,
    message,
)


@message("rp.svc.stats")
class StatsGet(Model):
    """Ask a service for its counters (fences fired, duplicates seen, dead letters...)."""


class DelayFault(Model):
    """Hold each outgoing message for a time drawn uniformly from [min_seconds, max_seconds]."""

    min_seconds: HoldSeconds
    max_seconds: HoldSeconds

    @model_validator(mode="after")
    def _ordered(self) -> DelayFault:
        if self.max_seconds < self.min_seconds:
            raise ValueError("max_seconds must not be below min_seconds")
        return self


class DuplicateFault(Model):
    """Send each outgoing message `copies` more times, the k-th copy `copy_delay_seconds` x k later."""

    copies: Copies
    bypass_dedupe: bool = False
    """Give each copy its own Nats-Msg-Id, so that the broker keeps it and the consumers must drop it."""
    copy_delay_seconds: HoldSeconds = 0.05


class ReorderFault(Model):
    """Hold outgoing messages until `window` are held (or the oldest waited `max_hold_seconds`), then
    release them shuffled. A window of 0 turns it off."""

    window: ReorderWindow
    max_hold_seconds: ReorderHoldSeconds = 0.5


class HoldAcksFault(Model):
    """Do not ack a handled message (so JetStream redelivers it after ack_wait): the next `count` ones,
    then each with `probability`."""

    probability: Probability = 0
    count: HeldAcks = 0


class RequestFault(Model):
    """Faults on the requests (commands) a service answers: each is handled twice with
    `duplicate_probability` (a request its sender retried), its reply held for up to
    `delay_reply_seconds`, or dropped with `drop_reply_probability` (the requester times out, and may ask
    again)."""

    duplicate_probability: Probability = 0
    delay_reply_seconds: HoldSeconds = 0
    drop_reply_probability: Probability = 0


@message("rp.svc.faults")
class ServiceFaults(Model):
    """Set or read the faults a service injects into its own messages (shared/faults.py).

    A field left null keeps its current setting, so a body with no field only reads them; `clear` first
    removes every fault and the subject filter. A fault is turned off by its zero value.
    """

    clear: bool = False
    delay: DelayFault | None = None
    duplicate: DuplicateFault | None = None
    reorder: ReorderFault | None = None
    drop_first_attempt: bool | None = None
    """Fail the first publish of each message (same subject and content), so that the sender's retry is
    what arrives."""
    hold_acks: HoldAcksFault | None = None
    slow_handler_seconds: HandlerDelaySeconds | None = None
    """Sleep this long before handling a message's first delivery, handled concurrently with the rest."""
    requests: RequestFault | None = None
    """Faults on the requests the service answers (not on its stats and faults subjects)."""
    only: SubjectPrefixes | None = None
    """Apply the faults only to subjects starting with one of these prefixes; empty: every subject."""
    seed: int | None = None
    """Seed the fault layer's random choices (delays, probabilities, shuffles), for a repeatable run."""
