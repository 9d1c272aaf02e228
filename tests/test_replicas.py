"""Two instance-manager replicas share the work (commands, consumers, sagas) through the broker's queue
groups and PostgreSQL's locks. A start's charge waits in the replica running its saga, while the outcome
may be read by the other one: the other replica's commit wakes it (PostgreSQL NOTIFY), not its resend
timer, so a start takes no longer beside a second replica."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from deploy.stack import Stack
from tests.conftest import GiB, assert_invariants, eventually, private_rack, unique, wait_state

REPLICAS = ("instance_manager", "instance-manager-2")


def ready(stack: Stack, key: str) -> bool:
    """Whether this one process answers ready (`wait_ready` asks the service, which any replica answers)."""
    try:
        with urllib.request.urlopen(stack.http_url(key, "/readyz"), timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def total(stack: Stack, key: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples (with these labels) on one process's /metrics."""
    with urllib.request.urlopen(stack.http_url(key), timeout=5) as r:
        text = r.read().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


async def test_a_charge_answered_through_the_other_replica_is_heard_at_once() -> None:
    async with private_rack("replicas", RACKPLANE_SLEDS="1") as (stack, client, db):
        stack.start_service("instance_manager", replica="instance-manager-2")
        await eventually(lambda: asyncio.to_thread(ready, stack, "instance-manager-2"), timeout=30)
        silo, proj = unique("silo"), unique("proj")
        await client.silo_create(silo)
        await client.project_create(silo, proj)
        names = [f"vm-{i}" for i in range(10)]
        for name in names:
            await client.instance_create(silo, proj, name, vcpus=1, ram_bytes=GiB, disk_bytes=GiB)
        for name in names:  # one at a time: each outcome goes to whichever replica's fetch is first
            await client.instance("start", silo, proj, name)
            await wait_state(client, silo, proj, name, "running")

        def outcomes(key: str) -> float:
            return total(
                stack,
                key,
                "rackplane_messages_handled_total",
                messaging_consumer_group_name="instance-manager-outcomes",
            )

        read = {key: await asyncio.to_thread(outcomes, key) for key in REPLICAS}
        assert all(read.values()), read  # both replicas read outcomes: some answered the other's charge
        timed_out = sum(
            [
                await asyncio.to_thread(total, stack, key, "rackplane_charge_waits_timed_out_total")
                for key in REPLICAS
            ]
        )
        # Before the notification, a charge whose outcome the other replica read waited out its 2 s
        # timer: about half of them. One is allowed for a slow second of a loaded machine.
        assert timed_out <= 1, timed_out
        await assert_invariants(db)
