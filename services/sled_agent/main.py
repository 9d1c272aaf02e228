"""The simulator process: N sleds, each consuming its own command subject, publishing inventory, and
answering simulator control requests (faults)."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from nats.aio.msg import Msg

from services.sled_agent.sled import SOURCE, Sled, Timing
from shared import bus, subjects
from shared.config import Settings, env_float, env_int
from shared.messages import Envelope, SimFaults, VmmDestroy, VmmEnsure, VmmStop
from shared.service import run_forever, serve_stats

log = logging.getLogger(__name__)

GiB = 2**30


def sleds_from_env(js: Any) -> list[Sled]:
    count = env_int("RACKPLANE_SLEDS", 8)
    timing = Timing(
        start_delay=env_float("RACKPLANE_VMM_START_DELAY", 0.2),
        stop_delay=env_float("RACKPLANE_VMM_STOP_DELAY", 0.1),
        report_retry=env_float("RACKPLANE_REPORT_RETRY", 1.0),
    )
    default = f"{env_int('RACKPLANE_SLED_VCPUS', 64)}:{env_int('RACKPLANE_SLED_RAM_GIB', 256)}"
    shapes = [shape.split(":") for shape in os.environ.get("RACKPLANE_SLED_SHAPES", default).split(",")]
    return [
        Sled(f"sled-{i}", int(shapes[i % len(shapes)][0]), int(shapes[i % len(shapes)][1]) * GiB, js, timing)
        for i in range(count)
    ]


async def command_loop(js: Any, sled: Sled) -> None:
    async def handle(env: Envelope, body: Any, msg: Msg) -> None:
        if isinstance(body, VmmEnsure):
            await sled.ensure(body)
        elif isinstance(body, VmmStop):
            await sled.stop(body)
        elif isinstance(body, VmmDestroy):
            await sled.destroy(body)

    await bus.Consumer(
        js,
        service="sled-agent",
        stream=subjects.SLED_CMD_STREAM,
        durable=f"sled-agent-{sled.sled_id}",
        filter_subject=subjects.sled_command(sled.sled_id, ">"),
        handler=handle,
        expect=(VmmEnsure, VmmStop, VmmDestroy),
    ).run()


async def inventory_loop(sleds: list[Sled], interval: float) -> None:
    while True:
        for s in sleds:
            try:
                await s.publish_inventory()
            except Exception as e:
                log.info("inventory of %s not sent: %s", s.sled_id, e)
        await asyncio.sleep(interval)


async def main(settings: Settings) -> None:
    nc = await bus.connect(settings.nats_url, "sled-agent")
    js = nc.jetstream()
    await bus.ensure_streams(js)
    sleds = sleds_from_env(js)
    by_id = {s.sled_id: s for s in sleds}

    async def set_faults(body: SimFaults, msg: Msg) -> dict[str, Any]:
        sled = by_id.get(body.sled_id)
        if sled is None:
            raise bus.NotFound(f"no simulated sled {body.sled_id!r}")
        sled.faults = body
        return {"sled_id": sled.sled_id, "faults": body.model_dump(mode="json")}

    await bus.serve(
        nc, subjects.sim_control("faults.set"), {SimFaults: set_faults}, queue=SOURCE, check_silo=False
    )
    await serve_stats(nc, SOURCE)
    log.info("simulating %d sleds: %s", len(sleds), ", ".join(by_id))
    await run_forever(
        inventory_loop(sleds, env_float("RACKPLANE_INVENTORY_INTERVAL", 5.0)),
        *(command_loop(js, s) for s in sleds),
    )
