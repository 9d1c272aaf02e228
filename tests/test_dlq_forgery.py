"""Dead letters that carry the truth, and letters no one can suppress (issue 29, attacks 1 and 2), each
attack made with the attacker's own credential (a sled's) against the session stack.

A sled may publish on its own DLQ subject, and every `Rp-Dlq-*` header is its word: a letter naming
another sled's destroy order, or a delta at generation 1000, must not be replayed (the instance keeps
running on its VMM, usage and `usage audit` unchanged). A sled that publishes the next letters' ids first
must not make a real letter vanish, and two consumers giving up on one message keep a letter each.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from deploy.stack import Stack
from rackctl import dead_letters as dlq
from rackctl import stored
from rackctl.client import Client
from shared.bus import MSG_ID, CommandError
from shared.messages import ProvisionDelta, SledInventory, VmmDestroy, VmmReport, VmmState, encode, envelope
from shared.topology import subjects
from tests.conftest import GiB, JetStreamAs, eventually, unique, usage_is, wait_state
from tests.test_cli import assert_ok, rackctl

SHAPE = {"vcpus": 1, "ram_bytes": GiB, "disk_bytes": 2 * GiB}


def _admin(stack: Stack) -> str:
    assert stack.security is not None and stack.nats_url
    return str(stack.security.write_context("dlq-admin", "dlq-admin", stack.nats_url))


async def file_letter(js: Any, sled: str, body: bytes, **claims: str) -> int:
    """A letter a sled files on its own DLQ subject (the only one the broker lets it), with headers of its
    choosing: its sequence in the DLQ."""
    headers = {MSG_ID: str(uuid.uuid4()), "Rp-Dlq-Reason": "handler failed 8 times: forged"}
    headers.update({f"Rp-Dlq-{k.title()}": v for k, v in claims.items()})
    ack = await js.publish(subjects.dead_letter("sled-agent", f"sled-agent-{sled}"), body, headers=headers)
    assert ack.stream == subjects.DLQ_STREAM
    return int(ack.seq)


async def refused(admin: Any, seq: int) -> str:
    """A replay with the dlq-admin identity, refused: its one-line reason. The letter stays."""
    with pytest.raises(CommandError) as e:
        await dlq.replay(admin, seq)
    assert e.value.code == "refused" and "\n" not in e.value.message, e.value
    assert (await dlq.get(admin, seq)).seq == seq
    return e.value.message


async def purge(admin: Any, *seqs: int) -> None:
    for seq in seqs:
        try:
            await dlq.delete(admin, seq)
        except dlq.NoDeadLetter:
            pass


async def other_sled(client: Client, *not_these: str) -> str:
    """A sled (once the simulator's have registered) that is none of these."""

    async def pick() -> str | None:
        return next((s["id"] for s in await client.sled_list() if s["id"] not in not_these), None)

    return str(await eventually(pick))


async def test_a_forged_destroy_letter_is_not_replayed_and_the_vm_keeps_running(
    stack: Stack, client: Client, project: tuple[str, str], jetstream_as: JetStreamAs
) -> None:
    silo, proj = project
    name = unique("vm")
    await client.instance_create(silo, proj, name, **SHAPE)
    await client.instance("start", silo, proj, name)
    v = await wait_state(client, silo, proj, name, "running")
    victim, vmm = v["sled_id"], v["active_vmm_id"]
    attacker = await other_sled(client, victim)
    js, admin = await jetstream_as(attacker), await jetstream_as("dlq-admin")
    ensure = await client.nc.jetstream().get_last_msg(
        subjects.SLED_CMD_STREAM, subjects.sled_command(victim, "vmm.ensure")
    )
    destroy = subjects.sled_command(victim, "vmm.destroy")
    body = encode(envelope(VmmDestroy(vmm_id=uuid.UUID(vmm)), "instance-manager"))
    own, mine = f"sled-agent-{attacker}", subjects.sled_command(attacker, "vmm.destroy")
    cmd = subjects.SLED_CMD_STREAM
    forgeries = [
        # the attack as it was made: another sled's consumer, subject and stream
        (
            f"names consumer 'sled-agent-{victim}'",
            "MISMATCH",
            dict(subject=destroy, stream=cmd, sequence=str(ensure.seq), consumer=f"sled-agent-{victim}"),
        ),
        # its own consumer, another sled's subject
        (
            f"which {own} does not read",
            "MISMATCH",
            dict(subject=destroy, stream=cmd, sequence=str(ensure.seq), consumer=own),
        ),
        # its own consumer and subject, and a real order's sequence: that order is on another subject
        (
            f"but {cmd} {ensure.seq} is on {ensure.subject}",
            "MISMATCH",
            dict(subject=mine, stream=cmd, sequence=str(ensure.seq), consumer=own),
        ),
        # a sequence that holds nothing: only the letter's body is left, which a sled may not publish there
        (
            "can be read, not replayed",
            "gone",
            dict(subject=mine, stream=cmd, sequence=str(10**12), consumer=own),
        ),
    ]
    seqs = [await file_letter(js, attacker, body, **claims) for _, _, claims in forgeries]
    try:
        # the runbook's command, as the operator on call runs it: refused, in one line
        r = await rackctl(stack, "dlq", "replay", str(seqs[0]), "--yes", "--context", _admin(stack))
        assert r.code == 1 and r.out == "" and len(r.err.strip().splitlines()) == 1, r
        assert f"dead letter {seqs[0]} (filed by {attacker}) is not replayed" in r.err, r
        for seq, (why, status, _) in zip(seqs, forgeries, strict=True):
            letter = await dlq.get(admin, seq)
            assert letter.filed_by == attacker and letter.filed_on.endswith(own), letter
            assert letter.check is not None and letter.check.status == status, letter
            assert why in await refused(admin, seq)
        # `dlq list` says who filed each, and flags them
        r = await rackctl(stack, "dlq", "list", "--service", "sled-agent")
        assert_ok(r)
        header, *lines = r.out.splitlines()
        assert header.split() == ["SEQ", "TIME", "FILER", "CONSUMER", "SUBJECT", "CHECK", "REASON"]
        rows = {line.split()[0]: line.split() for line in lines}
        assert [rows[str(s)][2] for s in seqs] == [attacker] * len(seqs)
        assert [rows[str(s)][5] for s in seqs] == [status for _, status, _ in forgeries]
        await asyncio.sleep(1)
        v = await client.instance("show", silo, proj, name)
        assert (v["state"], v["active_vmm_id"], v["sled_id"]) == ("running", vmm, victim)
        with pytest.raises(NotFoundError):  # no destroy order ever reached the victim
            await client.nc.jetstream().get_last_msg(cmd, destroy)
    finally:
        await purge(admin, *seqs)


async def test_a_forged_delta_letter_is_not_replayed_and_usage_is_unchanged(
    stack: Stack, client: Client, project: tuple[str, str], jetstream_as: JetStreamAs
) -> None:
    silo, proj = project
    name = unique("vm")
    inst = await client.instance_create(silo, proj, name, **SHAPE)
    v = await wait_state(client, silo, proj, name, "stopped")
    charged = {"vcpus": 0, "ram_bytes": 0, "disk_bytes": SHAPE["disk_bytes"]}
    await usage_is(client, charged, silo, proj)
    audit = ("usage", "audit", f"{silo}/{proj}", "--settle", "0", "--json")
    assert stack.database_url is not None
    before = await rackctl(stack, *audit, "--database-url", stack.database_url)
    assert_ok(before)
    # the real delta of its create, stored under its partition
    stored = [await _last(client, f"rp.acct.part.{p}.{silo}.{proj}.{inst['id']}") for p in range(4)]
    [real] = [m for m in stored if m is not None]
    partition = real.subject.split(".")[3]
    forged = ProvisionDelta(
        instance_id=uuid.UUID(inst["id"]),
        project_id=uuid.UUID(v["project_id"]),
        silo_id=uuid.UUID(v["silo_id"]),
        generation=1000,
        vcpus=7,
        ram_bytes=7 * GiB,
        disk_bytes=SHAPE["disk_bytes"],
    )
    body = encode(envelope(forged, "instance-manager"))
    attacker = await other_sled(client)
    js, admin = await jetstream_as(attacker), await jetstream_as("dlq-admin")
    stream = subjects.PROVISION_STREAM
    seqs = []
    try:
        for consumer in (subjects.delta_durable(partition), f"sled-agent-{attacker}"):
            claims = dict(subject=real.subject, stream=stream, sequence=str(real.seq), consumer=consumer)
            seq = await file_letter(js, attacker, body, **claims)
            seqs.append(seq)
            assert f"(filed by {attacker}) is not replayed" in await refused(admin, seq)
            letter = await dlq.get(admin, seq)
            assert letter.check is not None and letter.check.status == "MISMATCH", letter
        await asyncio.sleep(1)
        await usage_is(client, charged, silo, proj)
        after = await rackctl(stack, *audit, "--database-url", stack.database_url)
        assert_ok(after)
        assert after.json() == before.json() and after.json()["ok"]
        # and its real deltas still apply: deleted, it holds nothing
        await client.instance("delete", silo, proj, name)
        await usage_is(client, {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 0}, silo, proj)
    finally:
        await purge(admin, *seqs)


async def _last(client: Client, subject: str) -> Any:
    try:
        return await client.nc.jetstream().get_last_msg(subjects.PROVISION_STREAM, subject)
    except NotFoundError:
        return None


def _inventory(sled: str) -> bytes:
    """An inventory naming `sled`, to be sent on another sled's subject: every consumer refuses it."""
    body = SledInventory(
        sled_id=sled, boot_id=uuid.uuid4(), boot_number=1, seq=1, vcpus=8, ram_bytes=8 * GiB, vmms=[]
    )
    return encode(envelope(body, "forger"))


def _vmm_report(sled: str) -> bytes:
    body = VmmReport(
        sled_id=sled,
        boot_id=uuid.uuid4(),
        boot_number=1,
        seq=1,
        vmm_id=uuid.uuid4(),
        instance_id=uuid.uuid4(),
        state=VmmState.failed,
        generation=5,
    )
    return encode(envelope(body, "forger"))


async def letters_for(js: Any, start: int, stream: str, seq: int, want: int) -> list[dlq.DeadLetter]:
    """The dead letters (from DLQ sequence `start` on) about `stream`'s message `seq`, checked, once there
    are `want` of them."""

    async def found() -> Any:
        mine = []
        async for raw in stored.messages(js, subjects.DLQ_STREAM, "rp.dlq.>", start):
            h = raw.headers or {}
            if h.get("Rp-Dlq-Stream") == stream and h.get("Rp-Dlq-Sequence") == str(seq):
                mine.append(await dlq.get(js, raw.seq))
        return mine if len(mine) >= want else None

    return list(await eventually(found, timeout=20, interval=0.3))


async def dlq_end(client: Client) -> int:
    """Where the next dead letter will be stored."""
    return int((await client.nc.jetstream().stream_info(subjects.DLQ_STREAM)).state.last_seq) + 1


async def test_ids_taken_first_leave_every_real_letter_in_place(
    client: Client, jetstream_as: JetStreamAs
) -> None:
    """The attack: a sled files 30 letters under the next ids a letter about `SLED_REPORT` would have had
    (`dlq:SLED_REPORT:<seq>`, inside the duplicate window), then sends forged reports on its own subject
    (about another sled): instance-manager and recovery dead-letter them, and every letter is kept."""
    attacker = await other_sled(client)
    victim = await other_sled(client, attacker)
    js, admin = await jetstream_as(attacker), await jetstream_as("dlq-admin")
    report = subjects.SLED_REPORT_STREAM
    start = await dlq_end(client)
    last = (await client.nc.jetstream().stream_info(report)).state.last_seq
    taken = range(last + 1, last + 31)
    on = subjects.dead_letter("sled-agent", f"sled-agent-{attacker}")
    acks = await asyncio.gather(
        *(js.publish(on, b"pre-empted", headers={MSG_ID: f"dlq:{report}:{n}"}) for n in taken)
    )
    junk = [int(ack.seq) for ack in acks]
    try:
        vmm = await js.publish(subjects.sled_report(attacker, "vmm"), _vmm_report(victim))
        inv = await js.publish(subjects.sled_report(attacker, "inventory"), _inventory(victim))
        assert vmm.seq in taken and inv.seq in taken  # the ids their letters would have had are taken
        [by_im] = await letters_for(admin, start, report, vmm.seq, 1)
        assert by_im.filed_on == subjects.dead_letter("instance-manager", "instance-manager-vmm-reports")
        assert by_im.reason.startswith("forbidden") and by_im.check is not None and by_im.check.status == "ok"
        both = await letters_for(admin, start, report, inv.seq, 2)
        assert sorted(d.filed_by for d in both) == ["instance-manager", "recovery"]
        # the attacker's own letters are its own, flagged: they claim no consumer of its own
        taker = await dlq.get(admin, junk[0])
        assert taker.filed_by == attacker and taker.check is not None and taker.check.status == "MISMATCH"
        await purge(admin, by_im.seq, *(d.seq for d in both))
    finally:
        await purge(admin, *junk)


async def test_two_consumers_giving_up_on_one_message_keep_a_letter_each(
    stack: Stack, client: Client, jetstream_as: JetStreamAs
) -> None:
    sled = await other_sled(client)
    js, admin = await jetstream_as(sled), await jetstream_as("dlq-admin")
    start = await dlq_end(client)
    ack = await js.publish(subjects.sled_report(sled, "inventory"), b"\x00 not an inventory")
    both = await letters_for(admin, start, subjects.SLED_REPORT_STREAM, ack.seq, 2)
    assert sorted(d.filed_on for d in both) == [
        subjects.dead_letter("instance-manager", "instance-manager-inventory"),
        subjects.dead_letter("recovery", "recovery-inventory"),
    ]
    assert all(d.reason.startswith("malformed") and d.check and d.check.status == "ok" for d in both)
    r = await rackctl(stack, "dlq", "list", "--since", "10m", "--json")
    assert_ok(r)
    listed = [d for d in r.json() if d["original_seq"] == ack.seq and d["stream"] == "SLED_REPORT"]
    assert sorted(d["filed_by"] for d in listed) == ["instance-manager", "recovery"], listed
    assert [d["check"] for d in listed] == ["ok", "ok"]
    await purge(admin, *(d.seq for d in both))


async def test_a_letter_filed_twice_is_listed_once_and_replayed_once(
    stack: Stack, client: Client, jetstream_as: JetStreamAs
) -> None:
    """Each filing has an id of its own, so a consumer that files one message twice (its `term` lost)
    stores two letters: listed as one, with its repeat, and replayed (and deleted) as one."""
    sled = await other_sled(client)
    js, admin = await jetstream_as(sled), await jetstream_as("dlq-admin")
    start = await dlq_end(client)
    ack = await js.publish(subjects.sled_report(sled, "vmm"), b"\x00 not a report")
    [first] = await letters_for(admin, start, subjects.SLED_REPORT_STREAM, ack.seq, 1)
    # the same filing again, as instance-manager makes it (its own credential: its own DLQ subject)
    im = await jetstream_as("instance-manager")
    again = await im.publish(first.filed_on, first.data, headers=_letter_headers(first))
    r = await rackctl(stack, "dlq", "list", "--service", "instance-manager", "--since", "10m", "--json")
    assert_ok(r)
    listed = [d for d in r.json() if d["original_seq"] == ack.seq and d["stream"] == "SLED_REPORT"]
    assert [(d["seq"], d["repeats"]) for d in listed] == [(first.seq, [again.seq])]
    letter, replayed = await dlq.replay(admin, first.seq)
    assert letter.check is not None and letter.check.status == "ok"  # the original was sent
    for seq in (first.seq, again.seq):
        with pytest.raises(dlq.NoDeadLetter):
            await dlq.get(admin, seq)
        with pytest.raises(dlq.NoDeadLetter):
            await dlq.delete(admin, seq)
    # the replay, malformed as ever, is dead-lettered anew: once
    [anew] = await letters_for(admin, start, subjects.SLED_REPORT_STREAM, replayed, 1)
    assert anew.data == first.data and anew.check is not None and anew.check.status == "ok"
    await purge(admin, anew.seq)


def _letter_headers(d: dlq.DeadLetter) -> dict[str, str]:
    return {k: v for k, v in d.headers.items() if k != MSG_ID} | {MSG_ID: f"dlq:{uuid.uuid4()}"}


def test_who_files_where_is_read_off_the_grants() -> None:
    """The topology a letter is held to: the consumers that file on each DLQ subject, with the filter the
    broker holds each to, and who may publish what (deploy/identities.py)."""
    [sled] = dlq.readers(subjects.dead_letter("sled-agent", "sled-agent-sled-5"))
    assert (sled.stream, sled.durable) == ("SLED_CMD", "sled-agent-sled-5")
    assert sled.filter == subjects.sled_command("sled-5", ">")
    deltas = dlq.readers(subjects.dead_letter("accounting", subjects.DELTA_DEAD_LETTERS))
    assert [(r.durable, r.filter) for r in deltas] == [
        (subjects.delta_durable(p), subjects.delta_partition(p)) for p in range(subjects.DELTA_PARTITIONS)
    ]
    [inv] = dlq.readers(subjects.dead_letter("recovery", "recovery-inventory"))
    assert (inv.stream, inv.filter) == ("SLED_REPORT", subjects.sled_report("*", "inventory"))
    for nowhere in ("rp.dlq.sled-agent.sled-agent-nope", "rp.dlq.accounting.accounting-deltas-2", "rp.x"):
        assert dlq.readers(nowhere) == []
    # a body whose original is gone goes only where every identity that may file it could send it itself
    own = subjects.dead_letter("sled-agent", "sled-agent-sled-5")
    assert not dlq.could_publish(own, subjects.sled_command("sled-5", "vmm.destroy"))
    assert not dlq.could_publish(own, subjects.sled_report("sled-6", "vmm"))
    assert not dlq.could_publish(subjects.dead_letter("nobody", "x"), "rp.evt.acme.silo.created")
    assert dlq.could_publish(
        subjects.dead_letter("instance-manager", "x"), subjects.event("acme", "instance", "changed")
    )
