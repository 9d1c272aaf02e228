"""Silos and the projects within them: the tenancy every instance, pool and charge is named under.

Operators create, list and delete them (request/reply; a delete is refused while anything lives inside);
instance-manager announces each new one (events), so that accounting can hold its totals and quota before
the first charge arrives, and each deleted one.
"""

from __future__ import annotations

import uuid

from shared.messages.accounting import Quota
from shared.messages.base import CommandRate, Event, LimitCount, Model, Name, message
from shared.messages.paging import Paged


@message("rp.cmd.silo.create")
class SiloCreate(Model):
    name: Name
    quota: Quota = Quota()


@message("rp.cmd.silo.list")
class SiloList(Paged):
    pass


@message("rp.cmd.silo.show")
class SiloShow(Model):
    """A silo, its quota and its tenant limits (each with what it holds now): the silo's operator may ask."""

    silo: Name


@message("rp.cmd.silo.limits")
class SiloLimitsSet(Model):
    """The fleet operator sets a silo's tenant limits; a limit not given stays as it is. The silo is
    `name`, not `silo`, so that the command travels on `_fleet`, which no silo's operator may send on."""

    name: Name
    projects: LimitCount | None = None
    instances: LimitCount | None = None
    pool_members: LimitCount | None = None
    command_rate: CommandRate | None = None


@message("rp.cmd.silo.delete")
class SiloDelete(Model):
    """The fleet operator deletes a silo that holds no project (refused, `conflict`, naming them, while
    any lives). The silo is `name`, not `silo`, so that the command travels on `_fleet`, as `create`."""

    name: Name


@message("rp.cmd.project.create")
class ProjectCreate(Model):
    silo: Name
    name: Name


@message("rp.cmd.project.delete")
class ProjectDelete(Model):
    """Delete a project that holds no instance (whatever its state, but destroyed) and no pool (refused,
    `conflict`, saying how many of each, while any lives)."""

    silo: Name
    name: Name


@message("rp.cmd.project.list")
class ProjectList(Paged):
    silo: Name


@message("rp.evt.silo.created")
class SiloCreated(Event):
    silo_id: uuid.UUID
    name: Name
    quota: Quota


@message("rp.evt.project.created")
class ProjectCreated(Event):
    project_id: uuid.UUID
    silo_id: uuid.UUID
    silo: Name
    name: Name


@message("rp.evt.silo.deleted")
class SiloDeleted(Event):
    """The silo is gone and its name free: a silo created again with it is another silo (another id)."""

    silo_id: uuid.UUID
    name: Name


@message("rp.evt.project.deleted")
class ProjectDeleted(Event):
    """The project is gone and its name free in its silo: one created again with it has another id."""

    project_id: uuid.UUID
    silo_id: uuid.UUID
    silo: Name
    name: Name
