"""Running the checks: `check` (every violation, one line each) and `check_each` (by check), with the
checks the options call for, and `names` of those checks. `rackctl check` and the tests call these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from rackctl.dead_letters import Depth
from rackctl.invariants.acknowledged import Sent, no_acknowledged_command_lost
from rackctl.invariants.broker import (
    consumers_settled,
    latest_inventories,
    newest_inventory_applied,
    no_claimed_vmm_destroyed,
    no_zombie_vmms,
    pool_vms_handed_out_once,
)
from rackctl.invariants.failures import no_running_vmm_called_stuck, no_wrongful_kills, sled_boots
from rackctl.invariants.tables import ALWAYS, AT_REST, TIMED
from rackctl.invariants.timings import Timings


def recent_dead_letters(depth: Depth) -> list[str]:
    """No dead letter younger than the alert threshold: each is a message a consumer gave up on, which
    waits for an operator (`rackctl dlq`). Not an invariant of the rack, so `check` itself leaves it to
    `rackctl check`, which says how young is too young."""
    if not depth.recent or depth.newest is None:
        return []
    d = depth.newest
    return [
        f"{depth.recent} dead letter(s) newer than {_age(depth.within)} (of {depth.total} in the DLQ); the "
        f"newest, {d.seq} at {d.time.isoformat()}: {d.service}/{d.consumer} on {d.subject}: {d.reason} "
        "(rackctl dlq list)"
    ]


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


BROKER_AT_REST = (
    consumers_settled,
    no_zombie_vmms,
    pool_vms_handed_out_once,
    no_claimed_vmm_destroyed,
    no_wrongful_kills,
    newest_inventory_applied,
    no_running_vmm_called_stuck,
)


async def check(
    conn: asyncpg.Connection,
    *,
    at_rest: bool = True,
    js: JetStreamContext | None = None,
    nc: NATS | None = None,
    sent: Sequence[Sent] | None = None,
    timings: Timings | None = None,
) -> list[str]:
    """Every check's violations. With `js`, the broker checks too (at rest only); with `nc` as well, the
    failures the control plane made are held against the simulated sleds' boot history; with `js` and
    `sent` (the commands a caller sent, and their replies), what it was told is held against the rack.
    `timings`: the service timings judged by, this process's settings when not given."""
    found = await check_each(conn, at_rest=at_rest, js=js, nc=nc, sent=sent, timings=timings)
    return [line for lines in found.values() for line in lines]


async def check_each(
    conn: asyncpg.Connection,
    *,
    at_rest: bool = True,
    js: JetStreamContext | None = None,
    nc: NATS | None = None,
    sent: Sequence[Sent] | None = None,
    timings: Timings | None = None,
) -> dict[str, list[str]]:
    """Each check that ran, by name, with its violations (empty where it holds)."""
    t = timings or Timings.from_env()
    out: dict[str, list[str]] = {}
    for f in ALWAYS + (AT_REST if at_rest else ()):
        out[f.__name__] = await (f(conn, t) if f in TIMED else f(conn))
    if at_rest and js is not None:
        out["consumers_settled"] = await consumers_settled(js)
        latest = await latest_inventories(js)  # read once, for both checks that judge them
        out["no_zombie_vmms"] = await no_zombie_vmms(conn, js, latest)
        out["pool_vms_handed_out_once"] = await pool_vms_handed_out_once(js)
        out["no_claimed_vmm_destroyed"] = await no_claimed_vmm_destroyed(conn, js)
        out["newest_inventory_applied"] = await newest_inventory_applied(conn, js, latest, t)
        out["no_running_vmm_called_stuck"] = await no_running_vmm_called_stuck(conn, js)
    if at_rest and nc is not None and (boots := await sled_boots(nc)) is not None:
        out["no_wrongful_kills"] = await no_wrongful_kills(conn, boots)
    if at_rest and js is not None and sent is not None:
        out["no_acknowledged_command_lost"] = await no_acknowledged_command_lost(conn, js, sent)
    return out


def names(*, at_rest: bool = True, broker: bool = True, sent: bool = False) -> list[str]:
    """The checks `check` runs with these options, by name (`sent`: given the commands a caller sent)."""
    chosen: tuple[Any, ...] = ALWAYS + (AT_REST + (BROKER_AT_REST if broker else ()) if at_rest else ())
    told = (no_acknowledged_command_lost,) if at_rest and broker and sent else ()
    return [f.__name__ for f in chosen + told]
