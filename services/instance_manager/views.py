"""What an instance looks like from outside, and telling everyone when it changes: views read in one
query, and the change events written to the outbox in the caller's transaction (so that an event goes
out if and only if the change commits)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import asyncpg

from services.instance_manager.base import SOURCE, Q
from shared import bus
from shared.config import Settings
from shared.db import enqueue_many
from shared.messages import InstanceChanged, InstanceChangedV2, InstanceView, InstanceViewV2, Model
from shared.topology import subjects

if TYPE_CHECKING:
    from services.instance_manager.app import App


async def view(conn: asyncpg.Connection, instance_id: uuid.UUID, settings: Settings) -> InstanceView:
    found = await views(conn, [instance_id], settings)
    if not found:
        raise bus.NotFound(f"no instance {instance_id}")
    return found[0]


async def views(conn: asyncpg.Connection, ids: list[uuid.UUID], settings: Settings) -> list[InstanceView]:
    """The instances `ids`, in that order, in one query. An instance's health and next automatic restart
    follow the process's `settings` (`App.settings`)."""
    timing = (settings.unknown_after(), settings.restart_cooldown, settings.restart_backoff_max)
    rows = await conn.fetch(Q["instance_view"], ids, *timing)
    return [InstanceView.model_validate(dict(r)) for r in rows]


async def instance_changed(app: App, conn: asyncpg.Connection, instance_id: uuid.UUID) -> InstanceView:
    """Publish the instance as it now is, once the caller's transaction commits."""
    changed = await instances_changed(app, conn, [instance_id])
    if not changed:
        raise bus.NotFound(f"no instance {instance_id}")
    return changed[0]


async def instances_changed(app: App, conn: asyncpg.Connection, ids: list[uuid.UUID]) -> list[InstanceView]:
    """`instance_changed` for many instances: one query for their views, one statement for the events."""
    found = await views(conn, ids, app.settings)
    await enqueue_many(conn, [e for v in found for e in instance_events(v, v1=app.send_v1)], source=SOURCE)
    app.relay.kick()
    return found


def instance_events(v: InstanceView, *, v1: bool) -> list[tuple[str, Model, str | None]]:
    """What one change of an instance sends, as (subject, body, key): `rp.evt.instance.changed` v2 on its
    own subject, and v1 beside it while `v1` holds (the deprecation window, docs/subjects.md "Versions").
    Both are written to the outbox in the caller's transaction, so a reader gets both or neither; one
    that reads both finds the second a no-op (the same generation)."""
    events: list[tuple[str, Model, str | None]] = [
        (
            subjects.event(v.silo, "instance", "changed", version=2),
            InstanceChangedV2(instance=InstanceViewV2.model_validate(v.model_dump())),
            f"instance:{v.id}:{v.generation}:v2",
        )
    ]
    if v1:
        events.append(
            (
                subjects.event(v.silo, "instance", "changed"),
                InstanceChanged(instance=v),
                f"instance:{v.id}:{v.generation}",
            )
        )
    return events


def instance_reply(v: InstanceView) -> dict[str, Any]:
    return v.model_dump(mode="json")
