"""Acceptance 7: bad input gets a clear error reply or a dead-letter entry with the reason, and the
services go on serving."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
from nats.js.errors import NotFoundError

from rackctl.client import Client
from shared.bus import MSG_ID
from shared.messages import Reply
from shared.topology import subjects
from tests.conftest import GiB, JetStreamAs, counter, eventually, wait_state


def raw_envelope(schema: str, version: int, data: dict[str, Any]) -> bytes:
    return json.dumps(
        {
            "schema": schema,
            "version": version,
            "id": str(uuid.uuid4()),
            "source": "test",
            "time": datetime.now(UTC).isoformat(),
            "data": data,
        }
    ).encode()


async def raw_request(client: Client, subject: str, payload: bytes) -> Reply:
    msg = await client.nc.request(subject, payload, timeout=5)
    return Reply.model_validate_json(msg.data)


@pytest.mark.parametrize(
    ("payload", "code", "says"),
    [
        (b"{not json", "malformed", "not a valid envelope"),
        (b'{"schema": "rp.cmd.instance.start"}', "malformed", "version"),
        (raw_envelope("rp.cmd.instance.start", 99, {}), "unsupported_version", "version 99 is not supported"),
        (raw_envelope("rp.cmd.instance.reboot", 1, {}), "unknown_schema", "unknown schema"),
        (raw_envelope("rp.cmd.silo.create", 1, {"name": "x"}), "wrong_schema", "expected"),
        (
            raw_envelope(
                "rp.cmd.instance.create",
                1,
                {"silo": "s", "project": "p", "name": "n", "vcpus": 0, "ram_bytes": GiB, "disk_bytes": GiB},
            ),
            "invalid",
            "vcpus",
        ),
        (
            raw_envelope("rp.cmd.instance.start", 1, {"silo": "other", "project": "p", "name": "n"}),
            "forbidden",
            "sent on the subject of",
        ),
        (
            raw_envelope("rp.cmd.instance.start", 1, {"silo": "s", "project": "Bad Name!", "name": "n"}),
            "invalid",
            "project",
        ),
    ],
)
async def test_bad_commands_get_a_clear_error_reply(
    client: Client, payload: bytes, code: str, says: str
) -> None:
    reply = await raw_request(client, subjects.command("s", "instance", "start"), payload)
    assert not reply.ok and reply.error is not None
    assert reply.error["code"] == code
    assert says in reply.error["message"]


async def dead_letter(client: Client, service: str, consumer: str) -> Any:
    """The consumer's newest dead letter, or None while it has none."""
    js = client.nc.jetstream()
    try:
        return await js.get_last_msg(subjects.DLQ_STREAM, subjects.dead_letter(service, consumer))
    except NotFoundError:
        return None


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\x00\xffgarbage", "malformed: not a valid envelope"),
        (
            raw_envelope("rp.sled.vmm.report", 7, {}),
            "unsupported_version: schema rp.sled.vmm.report version 7",
        ),
        (
            raw_envelope(
                "rp.sled.vmm.report",
                1,
                {
                    "sled_id": "sled-0",
                    "boot_id": str(uuid.uuid4()),
                    "boot_number": 1,
                    "seq": 1,
                    "vmm_id": str(uuid.uuid4()),
                    "instance_id": str(uuid.uuid4()),
                    "state": "running",
                    "generation": 0,
                },
            ),
            "invalid: rp.sled.vmm.report v1: generation",
        ),
        (
            raw_envelope(
                "rp.sled.vmm.report",
                1,
                {
                    "sled_id": "sled-0",
                    "boot_id": str(uuid.uuid4()),
                    "boot_number": 1,
                    "seq": 1,
                    "vmm_id": str(uuid.uuid4()),
                    "instance_id": str(uuid.uuid4()),
                    "state": "exploded",
                    "generation": 3,
                },
            ),
            "invalid: rp.sled.vmm.report v1: state",
        ),
    ],
)
async def test_a_bad_sled_report_is_dead_lettered_with_its_reason(
    client: Client, jetstream_as: JetStreamAs, payload: bytes, reason: str
) -> None:
    js = await jetstream_as("sled-0")
    before = await counter(client, "instance-manager", "instance-manager-vmm-reports.dead_lettered")
    mark = str(uuid.uuid4())
    await js.publish(subjects.sled_report("sled-0", "vmm"), payload, headers={MSG_ID: mark})

    async def parked() -> bool:
        return (
            await counter(client, "instance-manager", "instance-manager-vmm-reports.dead_lettered") > before
        )

    await eventually(parked)
    entry = await dead_letter(client, "instance-manager", "instance-manager-vmm-reports")
    assert entry.data == payload  # nothing lost: the message itself is kept
    assert entry.headers["Rp-Dlq-Reason"].startswith(reason)
    assert entry.headers["Rp-Dlq-Subject"] == subjects.sled_report("sled-0", "vmm")
    assert entry.headers["Rp-Dlq-Stream"] == subjects.SLED_REPORT_STREAM


async def test_a_bad_delta_is_dead_lettered(client: Client, jetstream_as: JetStreamAs) -> None:
    js = await jetstream_as("instance-manager")
    payload = raw_envelope("rp.acct.delta", 1, {"instance_id": "nope"})
    await js.publish(
        subjects.provision_delta("s", "p", uuid.uuid4()), payload, headers={MSG_ID: str(uuid.uuid4())}
    )

    async def parked() -> Any:
        entry = await dead_letter(client, "accounting", "accounting-deltas")
        return entry if entry is not None and entry.data == payload else None

    entry = await eventually(parked)
    assert entry.headers["Rp-Dlq-Reason"].startswith("invalid: rp.acct.delta v1")


async def test_services_go_on_serving_after_bad_input(
    client: Client, db: asyncpg.Pool, project: tuple[str, str], jetstream_as: JetStreamAs
) -> None:
    js = await jetstream_as("sled-1")
    for i in range(5):
        await js.publish(
            subjects.sled_report("sled-1", "vmm"), b"junk", headers={MSG_ID: f"junk-{uuid.uuid4()}-{i}"}
        )
        await client.nc.request(subjects.command("s", "instance", "start"), b"junk", timeout=5)
    silo, proj = project
    await client.instance_create(silo, proj, "after", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "after")
    await wait_state(client, silo, proj, "after", "running")  # reports still flow, commands still answered
    await client.instance("stop", silo, proj, "after")
    await wait_state(client, silo, proj, "after", "stopped")


async def test_a_command_on_another_verbs_subject_is_refused(
    client: Client, project: tuple[str, str]
) -> None:
    """Permissions are granted per subject: a delete body sent on the `show` subject must not delete."""
    silo, proj = project
    await client.instance_create(silo, proj, "keep", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    payload = raw_envelope("rp.cmd.instance.delete", 1, {"silo": silo, "project": proj, "name": "keep"})
    reply = await raw_request(client, subjects.command(silo, "instance", "show"), payload)
    assert not reply.ok and reply.error is not None
    assert reply.error["code"] == "forbidden" and "belongs on" in reply.error["message"]
    assert (await client.instance("show", silo, proj, "keep"))["state"] == "stopped"


async def test_a_sled_cannot_report_for_another_sled(client: Client, jetstream_as: JetStreamAs) -> None:
    js = await jetstream_as("sled-3")  # its own credential, lying in the body
    report = raw_envelope(
        "rp.sled.vmm.report",
        1,
        {
            "sled_id": "sled-2",
            "boot_id": str(uuid.uuid4()),
            "boot_number": 1,
            "seq": 1,
            "vmm_id": str(uuid.uuid4()),
            "instance_id": str(uuid.uuid4()),
            "state": "stopped",
            "generation": 9,
        },
    )
    await js.publish(subjects.sled_report("sled-3", "vmm"), report, headers={MSG_ID: str(uuid.uuid4())})

    async def parked() -> Any:
        entry = await dead_letter(client, "instance-manager", "instance-manager-vmm-reports")
        return entry if entry is not None and entry.data == report else None

    entry = await eventually(parked)
    assert (
        entry.headers["Rp-Dlq-Reason"]
        == "forbidden: report for sled 'sled-2' sent on the subject of 'sled-3'"
    )


async def test_a_sled_cannot_report_on_another_sleds_vmm(
    client: Client, project: tuple[str, str], jetstream_as: JetStreamAs
) -> None:
    """On its own subject, about a VMM that runs on another sled: refused alone (dead-lettered), whatever
    else came in the same batch; the instance runs on, and its own sled's report in the batch applies."""
    silo, proj = project
    await client.instance_create(silo, proj, "victim", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
    await client.instance("start", silo, proj, "victim")
    victim = await wait_state(client, silo, proj, "victim", "running")
    liar = next(f"sled-{i}" for i in range(8) if f"sled-{i}" != victim["sled_id"])

    def report(vmm_id: Any, instance_id: Any) -> bytes:
        return raw_envelope(
            "rp.sled.vmm.report",
            1,
            {
                "sled_id": liar,
                "boot_id": str(uuid.uuid4()),
                "boot_number": 1,
                "seq": 1,
                "vmm_id": str(vmm_id),
                "instance_id": str(instance_id),
                "state": "failed",
                "generation": 10**6,
            },
        )

    forged = report(victim["active_vmm_id"], victim["id"])
    js = await jetstream_as(liar)
    for _ in range(3):  # its neighbours in the batch: well formed, about VMMs nobody knows, harmless
        unknown = report(uuid.uuid4(), uuid.uuid4())
        await js.publish(subjects.sled_report(liar, "vmm"), unknown, headers={MSG_ID: str(uuid.uuid4())})
    await js.publish(subjects.sled_report(liar, "vmm"), forged, headers={MSG_ID: str(uuid.uuid4())})

    async def parked() -> Any:
        entry = await dead_letter(client, "instance-manager", "instance-manager-vmm-reports")
        return entry if entry is not None and entry.data == forged else None

    entry = await eventually(parked)
    assert entry.headers["Rp-Dlq-Reason"] == (
        f"forbidden: {liar} reports on VMM {victim['active_vmm_id']}, which runs on {victim['sled_id']}: "
        "a sled speaks only for its own VMMs"
    )
    await client.instance("stop", silo, proj, "victim")  # its own sled's reports still apply
    await wait_state(client, silo, proj, "victim", "stopped")


async def test_a_sled_command_on_another_verbs_subject_is_dead_lettered(
    client: Client, jetstream_as: JetStreamAs
) -> None:
    """A client allowed only `rp.sled.*.cmd.vmm.destroy` cannot start a VMM by sending an ensure there."""
    js = await jetstream_as("instance-manager")
    ensure = raw_envelope(
        "rp.sled.vmm.ensure",
        1,
        {"vmm_id": str(uuid.uuid4()), "instance_id": str(uuid.uuid4()), "vcpus": 1, "ram_bytes": GiB},
    )
    await js.publish(
        subjects.sled_command("sled-4", "vmm.destroy"), ensure, headers={MSG_ID: str(uuid.uuid4())}
    )

    async def parked() -> Any:
        entry = await dead_letter(client, "sled-agent", "sled-agent-sled-4")
        return entry if entry is not None and entry.data == ensure else None

    entry = await eventually(parked)
    assert "it belongs on rp.sled.<sled>.cmd.vmm.ensure" in entry.headers["Rp-Dlq-Reason"]


async def test_a_simulator_request_on_another_verbs_subject_is_refused(client: Client) -> None:
    reboot = raw_envelope("rp.sim.sled.reboot", 1, {"sled_id": "sled-5"})
    reply = await raw_request(client, subjects.sim_control("sled.list"), reboot)
    assert not reply.ok and reply.error is not None and reply.error["code"] == "forbidden"
