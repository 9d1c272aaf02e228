"""Accounting's messages: the provisioning deltas instance-manager sends (JetStream,
rp.acct.delta.<silo>.<project>), the outcomes and usage accounting publishes, quotas, and the usage query.

Apart from the instance schemas because accounting never reads an instance's state: a delta states the
whole charge, which is all accounting needs to keep the totals and quotas.
"""

from __future__ import annotations

import uuid
from enum import StrEnum

from pydantic import field_validator

from shared.messages.base import (
    ChargedDisk,
    ChargedRam,
    ChargedVcpus,
    Event,
    Generation,
    HistoryBuckets,
    HistorySeconds,
    Model,
    Name,
    QuotaAmount,
    message,
    project_within_silo,
)


@message("rp.acct.delta")
class ProvisionDelta(Model):
    """What one instance should be charged, as of its state generation.

    It states the whole charge rather than a difference, so that applying it twice, or after a newer one,
    is detectable from the generation alone.
    """

    instance_id: uuid.UUID
    project_id: uuid.UUID
    silo_id: uuid.UUID
    generation: Generation
    vcpus: ChargedVcpus
    ram_bytes: ChargedRam
    disk_bytes: ChargedDisk


class Outcome(StrEnum):
    applied = "applied"
    refused = "refused"
    stale = "stale"


@message("rp.evt.provision.outcome")
class ProvisionOutcome(Event):
    instance_id: uuid.UUID
    generation: Generation
    outcome: Outcome
    reason: str = ""


class Usage(Event):
    vcpus: int
    ram_bytes: int
    disk_bytes: int


@message("rp.evt.usage.changed")
class UsageChanged(Event):
    silo_id: uuid.UUID
    project_id: uuid.UUID
    project: Usage
    silo: Usage


class Quota(Model):
    vcpus: QuotaAmount | None = None
    ram_bytes: QuotaAmount | None = None
    disk_bytes: QuotaAmount | None = None


@message("rp.cmd.usage.get")
class UsageGet(Model):
    silo: Name | None = None
    project: Name | None = None

    _project_needs_silo = field_validator("project")(project_within_silo)


@message("rp.cmd.usage.history")
class UsageHistoryGet(Model):
    """Usage of the fleet, a silo or a project over the last `since_seconds`, compacted into `buckets`
    intervals of equal length (each its least, greatest and last level), so that the reply stays small
    whatever the number of changes."""

    silo: Name | None = None
    project: Name | None = None
    since_seconds: HistorySeconds = 86400
    buckets: HistoryBuckets = 120

    _project_needs_silo = field_validator("project")(project_within_silo)
