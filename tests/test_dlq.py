"""Dead letters are handled, not hidden (issue 14, item 4): a dead-lettered message shows in `rackctl dlq
list` with its reason, filer, consumer and original subject; `replay` puts the stored original back on
the subject it was first sent on (and only the dlq-admin identity may); `purge` removes it; `rackctl
check` reports a young one. A real letter, of a malformed message or of one a handler failed on, replays
end to end as docs/operations.md says (issue 29: a replay sends what its stream stored, never the
letter; tests/test_dlq_forgery.py tries forged letters)."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from deploy.stack import Stack
from rackctl import dead_letters as dlq
from rackctl.client import Client
from shared.bus import DLQ_TRUNCATED, MSG_ID, CommandError, wire_size
from shared.topology import subjects
from tests.conftest import JetStreamAs, connect_as, eventually, unique
from tests.test_bad_input import raw_envelope
from tests.test_cli import assert_ok, rackctl


def _admin(stack: Stack) -> Path:
    assert stack.security is not None and stack.nats_url
    return stack.security.write_context("dlq-admin", "dlq-admin", stack.nats_url)


async def _bad_delta(stack: Stack, jetstream_as: JetStreamAs) -> tuple[dict[str, Any], bytes, str]:
    """A delta that accounting can never apply, sent with instance-manager's identity: its dead letter
    (as `rackctl dlq list --json` shows it), its payload, and the subject it was sent on."""
    js = await jetstream_as("instance-manager")
    instance = uuid.uuid4()
    sent_on = subjects.provision_delta(unique("silo"), "web", instance)
    payload = raw_envelope("rp.acct.delta", 1, {"instance_id": "nope"})
    await js.publish(sent_on, payload, headers={MSG_ID: str(uuid.uuid4())})

    async def listed() -> Any:
        r = await rackctl(stack, "dlq", "list", "--service", "accounting", "--json")
        assert_ok(r)
        return next((d for d in r.json() if d["replay_to"] == sent_on), None)

    return await eventually(listed), payload, sent_on


async def test_a_dead_letter_is_listed_with_its_reason_and_replays_to_its_subject(
    stack: Stack, client: Client, jetstream_as: JetStreamAs
) -> None:
    letter, payload, sent_on = await _bad_delta(stack, jetstream_as)
    assert letter["service"] == letter["filed_by"] == "accounting"
    assert letter["filed_on"] == "rp.dlq.accounting.accounting-deltas" and letter["check"] == "ok"
    assert letter["consumer"].startswith("accounting-deltas-")
    assert letter["reason"].startswith("invalid: rp.acct.delta v1")
    assert letter["stream"] == subjects.PROVISION_STREAM
    # stored under its partition, which no one may publish on; replayed on the subject it was sent on
    assert letter["subject"].startswith("rp.acct.part.") and letter["subject"].endswith(sent_on[14:])
    seq = letter["seq"]

    r = await rackctl(stack, "dlq", "list", "--service", "accounting")
    assert_ok(r)
    header, *rows = r.out.splitlines()
    assert header.split() == ["SEQ", "TIME", "FILER", "CONSUMER", "SUBJECT", "CHECK", "REASON"]
    [row] = [line for line in rows if line.split()[0] == str(seq)]
    assert row.split()[2:6] == ["accounting", letter["consumer"], letter["subject"], "ok"]
    assert "invalid: rp.acct.delta v1" in row

    r = await rackctl(stack, "dlq", "show", str(seq), "--json")
    assert_ok(r)
    shown = r.json()
    assert shown["headers"]["Rp-Dlq-Reason"] == letter["reason"]
    assert shown["payload"] == json.loads(payload)  # nothing lost: the message as it came
    r = await rackctl(stack, "dlq", "show", str(seq))
    assert_ok(r)
    assert re.search(rf"^replays to +{re.escape(sent_on)}$", r.out, re.M), r.out
    assert re.search(r"^header Rp-Dlq-Reason +invalid: rp.acct.delta v1", r.out, re.M), r.out
    assert re.search(r"^filed by +accounting \(on rp.dlq.accounting.accounting-deltas\)$", r.out, re.M)
    assert re.search(r"^check +ok$", r.out, re.M), r.out
    assert '"schema": "rp.acct.delta"' in r.out

    r = await rackctl(stack, "dlq", "replay", str(seq))
    assert r.code == 2 and "without --yes" in r.err, r
    # the console's (here the test identity's) rights read dead letters, and do not replay them
    r = await rackctl(stack, "dlq", "replay", str(seq), "--yes")
    assert r.code == 1 and "forbidden" in r.err and "--context dlq-admin" in r.err, r

    r = await rackctl(stack, "dlq", "replay", str(seq), "--yes", "--json", "--context", str(_admin(stack)))
    assert_ok(r)
    replayed = r.json()
    assert replayed["subject"] == sent_on and replayed["sent"] == "original"
    # it is in PROVISION again, as sent, under its own message id...
    auditor = await connect_as(stack, "auditor")
    try:
        again = await auditor.jetstream().get_msg(subjects.PROVISION_STREAM, seq=replayed["stream_seq"])
    finally:
        await auditor.close()
    assert again.data == payload and again.subject == letter["subject"]
    assert again.headers is not None and again.headers["Rp-Replay-Of"] == f"DLQ:{seq}"
    assert again.headers[MSG_ID].startswith(f"replay:DLQ:{seq}:")

    # ...gone from the DLQ, and accounting, which still cannot apply it, dead-letters it anew
    async def relisted() -> Any:
        r = await rackctl(stack, "dlq", "list", "--service", "accounting", "--json")
        mine = [d for d in r.json() if d["replay_to"] == sent_on]
        return mine if mine and mine[0]["seq"] != seq else None

    [anew] = await eventually(relisted)
    assert anew["original_seq"] == replayed["stream_seq"] and anew["reason"] == letter["reason"]
    r = await rackctl(stack, "dlq", "show", str(seq))
    assert r.code == 1 and f"no dead letter {seq}" in r.err, r

    # purge: refused without --yes, then gone
    r = await rackctl(stack, "dlq", "purge", str(anew["seq"]), "--context", str(_admin(stack)))
    assert r.code == 2, r
    r = await rackctl(stack, "dlq", "purge", str(anew["seq"]), "--yes", "--context", str(_admin(stack)))
    assert_ok(r)
    assert r.out.strip() == "deleted 1 dead letter(s)"
    r = await rackctl(stack, "dlq", "list", "--service", "accounting", "--json")
    assert all(d["replay_to"] != sent_on for d in r.json())


async def test_a_letter_a_handler_failed_on_replays_once_its_cause_is_fixed(
    stack: Stack, client: Client
) -> None:
    """The runbook's one letter a replay may mend: `handler failed 8 times`. Accounting's handler of
    `silo.created` fails on one silo (a trigger the test puts in its schema, as a bug would), so the silo
    is dead-lettered; once the cause is gone, the runbook's replay sends the stored event again and
    accounting knows the silo."""
    silo, fn = unique("dlqfail"), f"refuse_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(stack.admin_database_url)
    sql = f"""
        CREATE FUNCTION accounting.{fn}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.name = '{silo}' THEN RAISE EXCEPTION 'silo {silo} refused by the test'; END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER {fn} BEFORE INSERT OR UPDATE ON accounting.silos
            FOR EACH ROW EXECUTE FUNCTION accounting.{fn}();
    """
    fixed = f"DROP TRIGGER IF EXISTS {fn} ON accounting.silos; DROP FUNCTION IF EXISTS accounting.{fn}();"
    try:
        await admin.execute(sql)
        await client.silo_create(silo)
        sent_on = subjects.event(silo, "silo", "created")
        js = client.nc.jetstream()

        async def parked() -> Any:
            letters = await dlq.read(js, service="accounting", since=datetime.now(UTC) - timedelta(minutes=5))
            return next((d for d in letters if d.subject == sent_on), None)

        letter = await eventually(parked, timeout=60, interval=1.0)
        assert letter.reason.startswith("handler failed 8 times: RaiseError: ") and silo in letter.reason
        assert (letter.filed_by, letter.consumer, letter.stream) == (
            "accounting",
            "accounting-silos",
            "EVENTS",
        )
        assert letter.check is not None and letter.check.status == "ok"
        with pytest.raises(CommandError) as unknown:  # accounting does not know the silo
            await client.usage(silo)
        assert unknown.value.code == "not_found", unknown.value
        await admin.execute(fixed)  # the cause fixed
        r = await rackctl(stack, "dlq", "replay", str(letter.seq), "--yes", "--context", str(_admin(stack)))
        assert_ok(r)
        assert r.out.startswith(
            f"replayed dead letter {letter.seq} (the original, EVENTS {letter.original_seq}) to {sent_on}"
        ), r.out

        async def known() -> Any:
            try:
                return await client.usage(silo)
            except CommandError:
                return None

        assert (await eventually(known))["usage"] == {"vcpus": 0, "ram_bytes": 0, "disk_bytes": 0}
        r = await rackctl(stack, "dlq", "show", str(letter.seq))
        assert r.code == 1 and f"no dead letter {letter.seq}" in r.err, r
    finally:
        await admin.execute(fixed)
        await admin.close()


async def test_a_message_as_large_as_the_broker_takes_is_parked_with_its_beginning(
    stack: Stack, client: Client, jetstream_as: JetStreamAs
) -> None:
    """A body so near the broker's max payload that the dead-letter headers push it over: the broker
    would close the connection of whoever sent it whole (nats-py checks the body alone), so its beginning
    is parked, with the whole's size, and the consumer keeps going. Such a letter is read, not replayed."""
    js = await jetstream_as("instance-manager")
    sent_on = subjects.provision_delta(unique("silo"), "web", uuid.uuid4())
    headers = {MSG_ID: str(uuid.uuid4())}
    payload = b"{" + b"x" * (client.nc.max_payload - wire_size(b"{", headers))
    assert wire_size(payload, headers) == client.nc.max_payload
    await js.publish(sent_on, payload, headers=headers)

    async def listed() -> Any:
        r = await rackctl(stack, "dlq", "list", "--service", "accounting", "--json")
        assert_ok(r)
        return next((d for d in r.json() if d["replay_to"] == sent_on), None)

    letter = await eventually(listed)
    assert letter["reason"].startswith("malformed"), letter
    r = await rackctl(stack, "dlq", "show", str(letter["seq"]), "--json")
    assert_ok(r)
    shown = r.json()
    assert shown["headers"][DLQ_TRUNCATED] == str(len(payload))
    assert payload.startswith(shown["payload"].encode()) and len(shown["payload"]) < len(payload)
    r = await rackctl(stack, "dlq", "replay", str(letter["seq"]), "--yes", "--context", str(_admin(stack)))
    assert r.code == 1 and "can be read, not replayed" in r.err, r
    assert stack.services["accounting"].alive
    await _bad_delta(stack, jetstream_as)  # accounting still dead-letters what comes next


async def test_purge_older_than_keeps_the_young(stack: Stack, jetstream_as: JetStreamAs) -> None:
    letter, _, _ = await _bad_delta(stack, jetstream_as)
    admin = str(_admin(stack))
    r = await rackctl(stack, "dlq", "purge", "--older-than", "1d", "--yes", "--json", "--context", admin)
    assert_ok(r)
    assert letter["seq"] not in r.json()["deleted"]
    r = await rackctl(stack, "dlq", "list", "--since", "1h", "--json")
    assert letter["seq"] in [d["seq"] for d in r.json()]
    r = await rackctl(stack, "dlq", "purge", "--yes", "--context", admin)
    assert r.code == 2 and "SEQ" in r.err, r


async def test_rackctl_check_reports_a_young_dead_letter(stack: Stack, jetstream_as: JetStreamAs) -> None:
    letter, _, _ = await _bad_delta(stack, jetstream_as)
    assert stack.database_url is not None
    args = ("check", "--database-url", stack.database_url, "--settle", "0", "--json")
    r = await rackctl(stack, *args)
    data = json.loads(r.out)
    assert "no_recent_dead_letters" in data["checks"] and not data["ok"]
    assert data["dead_letters"]["recent"] >= 1 and data["dead_letters"]["within_seconds"] == 3600
    [line] = [v for v in data["violations"] if "dead letter(s) newer than 1h" in v]
    assert "(rackctl dlq list)" in line
    r = await rackctl(stack, *args, "--dead-letters-within", "0")
    assert not any("dead letter" in v for v in json.loads(r.out)["violations"])
    assert "no_recent_dead_letters" not in json.loads(r.out)["checks"]
    r = await rackctl(stack, *args, RACKPLANE_DLQ_ALERT="2h")
    assert json.loads(r.out)["dead_letters"]["within_seconds"] == 7200
    r = await rackctl(stack, *args, RACKPLANE_DLQ_ALERT="soon")
    assert r.code == 1 and "RACKPLANE_DLQ_ALERT" in r.err, r
    r = await rackctl(stack, "dlq", "purge", str(letter["seq"]), "--yes", "--context", str(_admin(stack)))
    assert_ok(r)
