"""Who files dead letters where, and what each consumer reads: the topology in code (deploy/identities.py's
grants, which the broker enforces). A letter is judged by its filer's subject, the one thing about it the
broker vouches for."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from deploy import identities
from shared.topology import durables, jsapi, subjects


@dataclass(frozen=True)
class Reader:
    """A durable consumer of rackplane's: the stream and filter it reads, the subject it files letters on."""

    stream: str
    durable: str
    filter: str


def sled_of(filed_on: str) -> str | None:
    """The sled whose own DLQ subject this is (`rp.dlq.sled-agent.sled-agent-<sled>`), or None."""
    filed = subjects.parse_dead_letter(filed_on)
    if filed is None or filed[0] != durables.SLED_AGENT:
        return None
    sled = subjects.sled_of_durable(filed[1])
    return sled if sled and identities.SLED_ID.match(sled) else None


def _files_under(durable: str) -> str:
    """The name a durable files its letters under: its own, but accounting's partitions share one."""
    try:
        return durables.named(durable).files_under
    except KeyError:  # a sled's: its own
        return durable


def _consumers(grants: identities.Grants) -> Iterator[Reader]:
    """The durables a grant lets its holder create, each with the filter the broker holds it to."""
    for p in grants.publish:
        if (named := jsapi.parse_consumer_create(p)) is not None:
            yield Reader(*named)


def readers(filed_on: str) -> list[Reader]:
    """The consumers that file their letters on `filed_on`."""
    filed = subjects.parse_dead_letter(filed_on)
    if filed is None:
        return []
    service = filed[0]
    if sled := sled_of(filed_on):
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
    if sled := sled_of(filed_on):
        candidates.append(identities.sled(sled))
    return [i for i in candidates if _may_publish(i.grants, filed_on)]


def could_publish(filed_on: str, subject: str) -> bool:
    """Whether every identity that may file on `filed_on` may itself publish on `subject`: then replaying
    a letter's own body there lends its filer no right it does not have."""
    filers = _filers(filed_on)
    return bool(filers) and all(_may_publish(i.grants, subject) for i in filers)


def _may_publish(g: identities.Grants, subject: str) -> bool:
    return any(subjects.matches(subject, p) for p in g.publish) and not any(
        subjects.matches(subject, p) for p in g.publish_deny
    )
