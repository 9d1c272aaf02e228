"""Warm pools: idle VMs of one shape, kept ready in a project so that a create can hand one out at once.
The operator's pool commands (request/reply, rp.cmd.<silo>.pool.<verb>) and the pool event.

Apart from instances because a pool is its own resource with its own lifecycle; an instance taken from
one is created with `InstanceCreate.from_pool`.
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import field_validator

from shared.messages.base import (
    DiskBytes,
    Event,
    Model,
    Name,
    PoolName,
    PoolSize,
    RamBytes,
    Vcpus,
    message,
    project_within_silo,
)
from shared.messages.paging import Paged


class PoolRef(Model):
    silo: Name
    project: Name
    name: PoolName


@message("rp.cmd.pool.create")
class PoolCreate(PoolRef):
    size: PoolSize
    vcpus: Vcpus
    ram_bytes: RamBytes
    disk_bytes: DiskBytes


@message("rp.cmd.pool.show")
class PoolShow(PoolRef):
    pass


@message("rp.cmd.pool.resize")
class PoolResize(PoolRef):
    size: PoolSize


@message("rp.cmd.pool.delete")
class PoolDelete(PoolRef):
    pass


@message("rp.cmd.pool.list")
class PoolList(Paged):
    silo: Name | None = None
    project: Name | None = None

    _project_needs_silo = field_validator("project")(project_within_silo)


class PoolView(Event):
    id: uuid.UUID
    silo: Name
    project: Name
    silo_id: uuid.UUID
    project_id: uuid.UUID
    name: str
    vcpus: int
    ram_bytes: int
    disk_bytes: int
    target_size: int
    state: Literal["active", "deleted"]
    generation: int
    idle: int
    provisioning: int
    handed_out: int


@message("rp.evt.pool.changed")
class PoolChanged(Event):
    """A pool was created, resized, deleted, or handed one of its VMs out (`instance_id`)."""

    pool: PoolView
    change: Literal["created", "resized", "deleted", "picked"]
    instance_id: uuid.UUID | None = None
