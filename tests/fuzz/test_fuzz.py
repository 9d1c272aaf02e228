"""The fuzz suite: hostile messages, sent with each outside identity's credential to every subject it may
publish on, against a real rack.

What must hold: no service process dies; no request gets an `internal` reply or no reply at all; no
near miss (a wrong JSON type, a NUL) is served or read as valid; every stream message the broker stored
is settled by its consumers, and each one that cannot be decoded is dead-lettered with its reason; and
the invariant checker is clean afterwards. The services' own identities are trusted components and are
not fuzzed (a broken instance-manager can do anything instance-manager may). `FUZZ_MESSAGES` sets how
many messages (`make fuzz`: 10,000, as CI runs it); `FUZZ_SEED` the seed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS

from deploy import identities
from rackctl.client import Client
from rackctl.invariants import consumers_settled
from shared.bus import DLQ_TRUNCATED
from shared.messages import (
    BadMessage,
    Model,
    Reply,
    SimSledList,
    SledInventory,
    VmmReport,
    decode,
    registry,
)
from shared.topology import subjects
from tests.conftest import GiB, assert_invariants, connect_as, private_rack, wait_state
from tests.fuzz.strategies import Real, Shot, shots

MESSAGES = int(os.environ.get("FUZZ_MESSAGES") or "400")
SEED = int(os.environ.get("FUZZ_SEED") or "20261203")
RECOVERY_ORDERS = {"rp.cmd.vmm.lost", "rp.cmd.vmm.stuck", "rp.cmd.vmm.zombie"} | {
    "rp.cmd.instance.restart",
    "rp.cmd.instance.settle",
}
VICTIM_SLED = "sled-3"
"""The one sled a forged expunge may name: the rack keeps the others."""


def command_targets(silo: str) -> list[tuple[str, list[type[Model]]]]:
    """Every operator command, on the silo's subjects and on `_fleet` (not recovery's orders)."""
    out = []
    for (schema, _), model in sorted(registry().items()):
        if schema.startswith("rp.cmd.") and schema not in RECOVERY_ORDERS:
            resource, verb = schema.removeprefix("rp.cmd.").split(".")
            out.append((subjects.command(silo, resource, verb), [model]))
    return out


def targets(silo: str) -> list[tuple[str, str, list[type[Model]]]]:
    """(identity, subject, the schemas that belong there) for each outside identity: each sends only on
    the subjects its own permissions allow (deploy/identities.py), with its own credential."""
    out: list[tuple[str, str, list[type[Model]]]] = []
    out += [("sled-0", subjects.sled_report("sled-0", "vmm"), [VmmReport])]
    out += [("sled-0", subjects.sled_report("sled-0", "inventory"), [SledInventory])]
    out += [("fleet-operator", s, m) for s, m in command_targets(subjects.FLEET)]
    out += [(f"silo-operator-{silo}", s, m) for s, m in command_targets(silo)]
    out += [("simulator-operator", subjects.sim_control("sled.list"), [SimSledList])]
    return out


def draw_shots(silo: str, real: Real, n: int) -> list[tuple[str, Shot]]:
    """`n` hostile messages, drawn by hypothesis (used here as a seeded generator)."""
    aims = targets(silo)
    drawn: list[tuple[str, Shot]] = []
    harmless = Real(real.uuids, real.silos, real.projects, real.names, [VICTIM_SLED])

    @seed(SEED)
    @settings(
        max_examples=n,
        phases=[Phase.generate],
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def one(data: st.DataObject) -> None:
        identity, subject, models = data.draw(st.sampled_from(aims))
        drawn.append((identity, data.draw(shots(subject, models, harmless))))

    one()
    return drawn[:n]


def is_stream(subject: str) -> bool:
    return subject.startswith("rp.sled.")


def decodable(payload: bytes) -> bool:
    try:
        decode(payload)
    except BadMessage:
        return False
    return True


async def fire(nc: NATS, shot: Shot, outcomes: Counter[str], problems: list[str]) -> bool:
    """Send one message; return whether the broker stored it in a stream."""
    try:
        if is_stream(shot.subject):
            await nc.jetstream().publish(shot.subject, shot.payload, timeout=10)
            outcomes["stored"] += 1
            if shot.kind == "near miss" and decodable(shot.payload):
                problems.append(f"near miss read as valid on {shot.subject}: {shot.payload[:300]!r}")
            return True
        raw = await nc.request(shot.subject, shot.payload, timeout=20)
    except nats.errors.MaxPayloadError:
        outcomes["too large for the broker"] += 1
        return False
    except nats.errors.NoRespondersError:
        outcomes["no responders"] += 1
        return False
    except nats.errors.TimeoutError:
        problems.append(f"no reply on {shot.subject} ({shot.kind} {shot.schema}): {shot.payload[:200]!r}")
        return False
    reply = Reply.model_validate_json(raw.data)
    code = "ok" if reply.ok else (reply.error or {}).get("code", "?")
    outcomes[f"reply {code}"] += 1
    if code == "ok" and shot.kind == "near miss":
        problems.append(f"near miss served on {shot.subject}: {shot.payload[:300]!r}")
    if code == "internal":
        problems.append(
            f"internal reply on {shot.subject} ({shot.kind}): {reply.error}: {shot.payload[:300]!r}"
        )
    return False


@dataclass
class Letters:
    """The dead letters: each whole one by its payload's digest, with the reasons it was parked for; and
    those whose body did not fit beside their headers, which keep the body's beginning (`Rp-Dlq-Truncated`
    holds the whole's size)."""

    reasons: dict[str, list[str]] = field(default_factory=dict)
    truncated: list[tuple[int, bytes]] = field(default_factory=list)

    def holds(self, payload: bytes) -> bool:
        return hashlib.sha256(payload).hexdigest() in self.reasons or any(
            size == len(payload) and payload.startswith(head) for size, head in self.truncated
        )


async def dead_letters(client: Client) -> Letters:
    out = Letters()
    sub = await client.nc.jetstream().subscribe("rp.dlq.>", ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except nats.errors.TimeoutError:
                return out
            headers = msg.headers or {}
            key = hashlib.sha256(msg.data or b"").hexdigest()
            out.reasons.setdefault(key, []).append(headers.get("Rp-Dlq-Reason", ""))
            if size := headers.get(DLQ_TRUNCATED):
                out.truncated.append((int(size), msg.data or b""))
    finally:
        await sub.unsubscribe()


def chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


async def test_hostile_messages_are_refused_or_dead_lettered_and_nothing_breaks() -> None:
    # Command rates high enough that every message reaches its reader: a command past a silo's rate is
    # answered `limited` before it is decoded (half of them at the default rates), and the limiter has
    # tests of its own (test_tenant_limits.py).
    rates = {"RACKPLANE_SILO_COMMAND_RATE": "1000000", "RACKPLANE_IDENTITY_COMMAND_RATE": "1000000"}
    async with private_rack("fuzz", RACKPLANE_SLEDS="4", **rates) as (stack, client, db):
        silo = "fuzzed"
        await client.silo_create(silo)
        await client.project_create(silo, "p")
        await client.instance_create(silo, "p", "vm", vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        await client.instance("start", silo, "p", "vm")
        v = await wait_state(client, silo, "p", "vm", "running")
        real = Real(
            uuids=[v["id"], v["active_vmm_id"], v["silo_id"], v["project_id"]],
            silos=[silo],
            projects=["p"],
            names=["vm"],
        )
        drawn = draw_shots(silo, real, MESSAGES)
        assert stack.security is not None and stack.nats is not None
        if f"silo-operator-{silo}" not in stack.security.store.identities:
            stack.security.add(identities.silo_operator(silo))
        stack.nats.reload()
        senders = {name: await connect_as(stack, name) for name in {i for i, _ in drawn}}
        outcomes: Counter[str] = Counter()
        problems: list[str] = []
        stored_undecodable: list[Shot] = []
        started = time.monotonic()
        for batch in chunks(drawn, 32):
            stored = await asyncio.gather(
                *(fire(senders[who], shot, outcomes, problems) for who, shot in batch)
            )
            stored_undecodable += [
                s for (_, s), kept in zip(batch, stored, strict=True) if kept and not decodable(s.payload)
            ]
        took = time.monotonic() - started
        for nc in senders.values():
            await nc.close()
        print(f"\nfuzz: {len(drawn)} messages in {took:.1f}s, seed {SEED}: {dict(sorted(outcomes.items()))}")
        print(f"  kinds: {dict(Counter(s.kind for _, s in drawn))}")
        print(f"  identities: {dict(Counter(i for i, _ in drawn))}")

        assert not problems, "\n".join(problems[:20])
        js = client.nc.jetstream()
        deadline = time.monotonic() + 60
        while unsettled := await consumers_settled(js):
            assert time.monotonic() < deadline, unsettled
            await asyncio.sleep(1)
        letters = await dead_letters(client)
        missing = [s for s in stored_undecodable if not letters.holds(s.payload)]
        assert not missing, f"{len(missing)} undecodable messages were not dead-lettered: {missing[:3]}"
        assert all(all(r) for r in letters.reasons.values()), "a dead letter without its reason"
        dead = [name for name, svc in stack.services.items() if not svc.alive]
        assert not dead, f"processes died: {dead}"
        await assert_invariants(db, timeout=60)
