"""Silos and the projects within them: the tenancy every instance, pool and charge is named under.

Operators create and list them (request/reply); instance-manager announces each new one (events), so that
accounting can hold its totals and quota before the first charge arrives.
"""

from __future__ import annotations

import uuid

from shared.messages.accounting import Quota
from shared.messages.base import Event, Model, Name, message
from shared.messages.paging import Paged


@message("rp.cmd.silo.create")
class SiloCreate(Model):
    name: Name
    quota: Quota = Quota()


@message("rp.cmd.silo.list")
class SiloList(Paged):
    pass


@message("rp.cmd.project.create")
class ProjectCreate(Model):
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
