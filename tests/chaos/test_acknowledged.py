"""`no_acknowledged_command_lost` (rackctl/invariants/), the invariant the chaos soak holds every ok reply to:
silent on what the rack was told and did, and reporting each kind of promise broken. The commands are real
(on the session stack); a broken promise is a reply the rack never gave, added to what it did give: the
checker compares the two, so a reply whose effect is missing and a rack that lost an effect look alike.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from rackctl import invariants as checker
from rackctl.client import Client
from rackctl.invariants import Sent
from tests.conftest import GiB, eventually, wait_state


async def lost(db: asyncpg.Pool, client: Client, sent: list[Sent]) -> list[str]:
    async with db.acquire() as conn:
        return await checker.no_acknowledged_command_lost(conn, client.nc.jetstream(), sent)


def told(seq: int, verb: str, silo: str, project: str | None, name: str, reply: Any = None) -> Sent:
    data = reply if isinstance(reply, dict) else {}
    return Sent(seq, verb, silo, project, name, True, data.get("state"), data.get("generation"))


async def test_every_kind_of_acknowledged_command_lost_is_reported_and_none_when_kept(
    client: Client, db: asyncpg.Pool, project: tuple[str, str]
) -> None:
    silo, proj = project
    sent = [told(0, "silo create", silo, None, silo), told(1, "project create", silo, None, proj)]
    for i, name in enumerate(("kept", "ran", "ended", "gone"), start=2):
        reply = await client.instance_create(silo, proj, name, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        sent.append(told(i, "instance create", silo, proj, name, reply))
    for name in ("ran", "ended"):
        await client.instance("start", silo, proj, name)
        await wait_state(client, silo, proj, name, "running")
    ran = await client.instance("start", silo, proj, "ran")  # running already: answered running
    assert ran["state"] == "running"
    stopped = await client.instance("stop", silo, proj, "ended")
    deleted = await client.instance("delete", silo, proj, "gone")
    sent += [
        told(6, "instance start", silo, proj, "ran", ran),
        told(7, "instance stop", silo, proj, "ended", stopped),
        told(8, "instance delete", silo, proj, "gone", deleted),
    ]
    await wait_state(client, silo, proj, "ended", "stopped")

    async def kept() -> bool:  # the last changes' events are published a moment after their commits
        return not await lost(db, client, sent)

    await eventually(kept, timeout=10)

    still = await client.instance("show", silo, proj, "ran")
    broken = [
        told(10, "project create", silo, None, "never-made"),
        told(11, "instance create", silo, proj, "never-made", {"state": "stopped", "generation": 2}),
        told(12, "instance delete", silo, proj, "kept", {"state": "destroyed"}),
        told(13, "instance start", silo, proj, "ran", {**still, "generation": still["generation"] + 5}),
        told(14, "instance stop", silo, proj, "ran", still | {"state": "stopping"}),
        told(15, "instance start", silo, proj, "kept", {"state": "running", "generation": 1}),
    ]
    found = await lost(db, client, sent + broken)
    assert len(found) == len(broken), found
    for line, why in zip(
        found,
        [
            "no such project",
            "no record of the instance",
            "still stopped",
            "before what the reply gave",
            "stopped at no generation",
            "running at no generation",
        ],
        strict=True,
    ):
        assert why in line, (why, line)

    # An instance created and gone: lost, unless a delete of it was sent; one that got no reply may have
    # run, and so may a create answered while its saga still ran (it may have been unwound since).
    undeleted = [s for s in sent if s.verb != "instance delete"]
    assert [line for line in await lost(db, client, undeleted) if "destroyed" in line] == [
        f"instance create {silo}/{proj}/gone (#5, answered stopped at generation "
        f"{sent[5].generation}): destroyed, and no delete of it was sent"
    ]
    unknown = Sent(16, "instance delete", silo, proj, "gone", acked=False)
    assert not await lost(db, client, [*undeleted, unknown])
    creating = told(17, "instance create", silo, proj, "gone", {"state": "creating", "generation": 1})
    assert not await lost(db, client, [*sent[:5], creating])
    assert "no_acknowledged_command_lost" in checker.names(sent=True)
    assert "no_acknowledged_command_lost" not in checker.names()
