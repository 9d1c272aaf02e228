"""Checks that stay in the services whatever the broker allows: a delta whose subject, silo and project
disagree is dead-lettered with the reason and charges nothing; amounts past their limits are refused;
an outcome for a charge instance-manager is not waiting for changes nothing."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import pytest
from pydantic import ValidationError

from rackctl.client import Client
from shared import messages as m
from shared.bus import MSG_ID
from shared.messages import ProvisionDelta, ProvisionOutcome, encode, envelope
from shared.topology import subjects
from tests.conftest import GiB, JetStreamAs, counter, eventually, unique, usage_is, wait_state
from tests.test_bad_input import dead_letter


async def new_project(
    client: Client, db: asyncpg.Pool, silo: str | None = None
) -> tuple[str, str, uuid.UUID, uuid.UUID]:
    """A project (in a new silo unless given), once accounting knows of both."""
    silo = silo or unique("forge")
    proj = unique("proj")
    if not await db.fetchval("SELECT 1 FROM accounting.silos WHERE name = $1", silo):
        await client.silo_create(silo)
    p = await client.project_create(silo, proj)

    async def known() -> Any:
        return await db.fetchrow(
            "SELECT p.id, p.silo_id FROM accounting.projects p WHERE p.id = $1", uuid.UUID(p["id"])
        )

    row = await eventually(known)
    return silo, proj, row["silo_id"], row["id"]


async def totals(db: asyncpg.Pool) -> list[tuple[Any, ...]]:
    rows = await db.fetch(
        "SELECT 'silo', id, vcpus, ram_bytes, disk_bytes FROM accounting.silos UNION ALL "
        "SELECT 'project', id, vcpus, ram_bytes, disk_bytes FROM accounting.projects UNION ALL "
        "SELECT 'fleet', NULL, sum(vcpus), sum(ram_bytes), sum(disk_bytes) FROM accounting.silos "
        "ORDER BY 1, 2"
    )
    return [tuple(r) for r in rows]


async def publish_delta(js: Any, silo: str, project: str, d: ProvisionDelta) -> bytes:
    """Sent with instance-manager's credential: the broker lets only it publish deltas, so a forgery
    reaching accounting comes from a compromised or buggy instance-manager."""
    payload = encode(envelope(d, "forger"))
    await js.publish(
        subjects.provision_delta(silo, project, d.instance_id), payload, headers={MSG_ID: str(uuid.uuid4())}
    )
    return payload


async def parked(client: Client, payload: bytes) -> Any:
    async def check() -> Any:
        entry = await dead_letter(client, "accounting", "accounting-deltas")
        return entry if entry is not None and entry.data == payload else None

    return await eventually(check)


def delta(project_id: uuid.UUID, silo_id: uuid.UUID, instance_id: uuid.UUID | None = None) -> ProvisionDelta:
    return ProvisionDelta(
        instance_id=instance_id or uuid.uuid4(),
        project_id=project_id,
        silo_id=silo_id,
        generation=10**6,
        vcpus=64,
        ram_bytes=64 * GiB,
        disk_bytes=1024 * GiB,
    )


async def test_forged_deltas_are_dead_lettered_with_the_reason_and_charge_nothing(
    client: Client, db: asyncpg.Pool, jetstream_as: JetStreamAs
) -> None:
    im = await jetstream_as("instance-manager")
    a, pa, a_id, pa_id = await new_project(client, db)
    _, pa2, _, pa2_id = await new_project(client, db, a)
    b, pb, b_id, pb_id = await new_project(client, db)
    await client.instance_create(a, pa, "real", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    real = (await client.instance("show", a, pa, "real"))["id"]
    await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": GiB}, a, pa)
    before = await totals(db)

    cases = [
        # silo B's ids on silo A's subject
        ((a, pa), delta(pb_id, b_id), f"forged: subject names silo {a}, but silo {b_id} is {b}"),
        # silo A, with a project of silo B
        ((a, pb), delta(pb_id, a_id), f"forged: project {pb_id} belongs to silo {b}, not to {a}"),
        # silo A's project ids under another project's name
        ((a, pa2), delta(pa_id, a_id), f"forged: subject names project {pa2}, but project {pa_id} is {pa}"),
        # a real instance of A/pa, charged to A/pa2
        ((a, pa2), delta(pa2_id, a_id, uuid.UUID(real)), f"forged: instance {real} is charged to project"),
    ]
    for (silo, proj), d, reason in cases:
        entry = await parked(client, await publish_delta(im, silo, proj, d))
        assert entry.headers["Rp-Dlq-Reason"].startswith(reason), entry.headers
    assert await totals(db) == before
    assert not await db.fetchval(
        "SELECT count(*) FROM accounting.instance_charges WHERE generation = $1", 10**6
    )
    assert await counter(client, "accounting", "deltas.forged") >= len(cases)


@pytest.mark.parametrize(
    ("model", "fields"),
    [
        (m.ProvisionDelta, {"vcpus": m.MAX_INSTANCE_VCPUS + 1}),
        (m.ProvisionDelta, {"ram_bytes": m.MAX_INSTANCE_RAM_BYTES + 1}),
        (m.ProvisionDelta, {"disk_bytes": m.MAX_DISK_BYTES + 1}),
        (m.ProvisionDelta, {"disk_bytes": 2**63}),
        (m.ProvisionDelta, {"vcpus": -1}),
        (m.VmmEnsure, {"vcpus": m.MAX_INSTANCE_VCPUS + 1}),
        (m.VmmEnsure, {"ram_bytes": m.MAX_INSTANCE_RAM_BYTES + 1}),
        (m.SledInventory, {"vcpus": m.MAX_SLED_VCPUS + 1}),
        (m.SledInventory, {"ram_bytes": m.MAX_SLED_RAM_BYTES + 1}),
        (m.Quota, {"disk_bytes": m.MAX_TOTAL + 1}),
        (m.InstanceCreate, {"disk_bytes": m.MAX_DISK_BYTES + 1}),
    ],
)
def test_amounts_past_their_limits_are_refused(model: type[m.Model], fields: dict[str, int]) -> None:
    ok: dict[str, dict[str, Any]] = {
        "ProvisionDelta": {
            "instance_id": uuid.uuid4(),
            "project_id": uuid.uuid4(),
            "silo_id": uuid.uuid4(),
            "generation": 1,
            "vcpus": m.MAX_INSTANCE_VCPUS,
            "ram_bytes": m.MAX_INSTANCE_RAM_BYTES,
            "disk_bytes": m.MAX_DISK_BYTES,
        },
        "VmmEnsure": {
            "vmm_id": uuid.uuid4(),
            "instance_id": uuid.uuid4(),
            "vcpus": m.MAX_INSTANCE_VCPUS,
            "ram_bytes": m.MAX_INSTANCE_RAM_BYTES,
        },
        "SledInventory": {
            "sled_id": "sled-0",
            "boot_id": uuid.uuid4(),
            "boot_number": 1,
            "seq": 0,
            "vcpus": m.MAX_SLED_VCPUS,
            "ram_bytes": m.MAX_SLED_RAM_BYTES,
            "vmms": [],
        },
        "Quota": {"vcpus": m.MAX_TOTAL, "ram_bytes": m.MAX_TOTAL, "disk_bytes": m.MAX_TOTAL},
        "InstanceCreate": {
            "silo": "s",
            "project": "p",
            "name": "n",
            "vcpus": m.MAX_INSTANCE_VCPUS,
            "ram_bytes": m.MAX_INSTANCE_RAM_BYTES,
            "disk_bytes": m.MAX_DISK_BYTES,
        },
    }
    base = ok[model.__name__]
    model.model_validate(base)  # the limits themselves are allowed
    with pytest.raises(ValidationError, match=next(iter(fields))):
        model.model_validate({**base, **fields})


def test_no_sum_of_charges_at_their_limits_can_overflow_a_bigint() -> None:
    """Accounting refuses a charge taking a total past MAX_TOTAL; the largest charge is far below the
    rest of the bigint range, so even many concurrent ones cannot overflow."""
    biggest = max(m.MAX_INSTANCE_VCPUS, m.MAX_INSTANCE_RAM_BYTES, m.MAX_DISK_BYTES)
    assert m.MAX_TOTAL + 10_000 * biggest < 2**63


async def test_an_oversized_delta_on_the_bus_is_dead_lettered(
    client: Client, jetstream_as: JetStreamAs
) -> None:
    from tests.test_bad_input import raw_envelope

    data = delta(uuid.uuid4(), uuid.uuid4()).model_dump(mode="json") | {"disk_bytes": 2**62}
    payload = raw_envelope("rp.acct.delta", 1, data)
    await (await jetstream_as("instance-manager")).publish(
        subjects.provision_delta("s", "p", uuid.uuid4()), payload, headers={MSG_ID: str(uuid.uuid4())}
    )
    entry = await parked(client, payload)
    assert entry.headers["Rp-Dlq-Reason"].startswith("invalid: rp.acct.delta v1: disk_bytes")


async def test_an_unsolicited_outcome_changes_nothing(
    client: Client, db: asyncpg.Pool, project: tuple[str, str], jetstream_as: JetStreamAs
) -> None:
    silo, proj = project
    await client.instance_create(silo, proj, "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "vm")
    v = await wait_state(client, silo, proj, "vm", "running")
    outcomes = (
        "SELECT instance_id, generation, outcome FROM instance_manager.charge_outcomes WHERE instance_id = $1"
    )
    before = await db.fetch(outcomes, uuid.UUID(v["id"]))
    dropped = await counter(client, "instance-manager", "outcomes.unsolicited")

    forged = [
        ProvisionOutcome(instance_id=uuid.UUID(v["id"]), generation=10**6, outcome=m.Outcome.refused),
        ProvisionOutcome(instance_id=uuid.uuid4(), generation=1, outcome=m.Outcome.applied),
    ]
    js = await jetstream_as("accounting")  # the only identity that may publish outcomes
    for o in forged:
        await js.publish(
            subjects.event(silo, "provision", "outcome"),
            encode(envelope(o, "forger")),
            headers={MSG_ID: str(uuid.uuid4())},
        )

    async def counted() -> bool:
        return await counter(client, "instance-manager", "outcomes.unsolicited") >= dropped + len(forged)

    await eventually(counted)
    assert await db.fetch(outcomes, uuid.UUID(v["id"])) == before
    assert not await db.fetchval(
        "SELECT count(*) FROM instance_manager.charge_outcomes WHERE instance_id = $1", forged[1].instance_id
    )
    # and the instance goes on as before
    await client.instance("stop", silo, proj, "vm")
    await wait_state(client, silo, proj, "vm", "stopped")
