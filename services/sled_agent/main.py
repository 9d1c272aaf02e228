"""The simulator process: N sleds, each consuming its own command subject and publishing its inventory,
and the simulator's control requests (faults, reboot, freeze, thaw, capacity, add, remove)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from services.sled_agent import identity
from services.sled_agent.sled import SOURCE, Sled, Timing, rack_boots, read_rack_boots
from shared import bus, telemetry, topology
from shared.config import Settings
from shared.messages import (
    Envelope,
    SimFaults,
    SimRackReboot,
    SimSledAdd,
    SimSledFreeze,
    SimSledHeal,
    SimSledList,
    SimSledPartition,
    SimSledReboot,
    SimSledRemove,
    SimSledThaw,
    VmmDestroy,
    VmmEnsure,
    VmmMigrate,
    VmmStop,
    schema_of,
)
from shared.messages.simulator import SimSledCapacity
from shared.service import connect_bus, run_forever, serve_faults, serve_stats

log = logging.getLogger(__name__)

GiB = 2**30


def timing_of(settings: Settings) -> Timing:
    return Timing(
        start_delay=settings.vmm_start_delay,
        stop_delay=settings.vmm_stop_delay,
        report_retry=settings.report_retry,
        migrate_delay=settings.migrate_delay,
        migrate_timeout=settings.migrate_timeout,
        inventory_ttl=settings.inventory_keep(),
    )


@dataclass
class Simulator:
    settings: Settings
    timing: Timing
    state_dir: Path | None
    sleds: dict[str, Sled] = field(default_factory=dict)
    _loops: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    async def load_or_create(self) -> None:
        """Sleds kept from an earlier run come back as they were; otherwise RACKPLANE_SLEDS new ones."""
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            rack_boot = read_rack_boots(self.state_dir)
            for path in sorted(self.state_dir.glob("sled-*.json")):
                nc = await identity.connect(self.settings, path.stem)
                sled = Sled.load(path, nc, self.timing, rack_boot.get(path.stem))
                self.sleds[sled.sled_id] = sled
        if self.sleds:
            log.info("resumed %d sleds from %s", len(self.sleds), self.state_dir)
            return
        s = self.settings
        shapes = s.sled_shapes or [(s.sled_vcpus, s.sled_ram_gib)]
        for i in range(s.sleds):
            vcpus, ram_gib = shapes[i % len(shapes)]
            await self.add(vcpus, ram_gib * GiB)

    async def add(self, vcpus: int, ram_bytes: int) -> Sled:
        n = max((int(s.removeprefix("sled-")) for s in self.sleds), default=-1) + 1
        sled_id = f"sled-{n}"
        try:
            nc = await identity.connect(self.settings, sled_id)  # its own credential
        except identity.NoCredential as e:
            raise bus.CommandError("refused", str(e)) from None
        sled = Sled(sled_id, vcpus, ram_bytes, nc, self.timing, self.state_dir)
        sled._save(now=True)
        self.sleds[sled.sled_id] = sled
        return sled

    def start(self, sled: Sled) -> None:
        sled.peer = self.sleds.get
        sled.resume()
        orders = command_loop(sled, self.settings.inventory_interval, self.settings.ack_wait)
        self._loops[sled.sled_id] = asyncio.create_task(orders)

    def remove(self, sled_id: str) -> None:
        """The sled leaves the rack for good, without a word: it is never heard from again."""
        sled = self.sleds.pop(sled_id)
        if (loop := self._loops.pop(sled_id, None)) is not None:
            loop.cancel()
        sled.shut_down()
        asyncio.get_running_loop().create_task(sled.nc.close())

    def get(self, sled_id: str) -> Sled:
        sled = self.sleds.get(sled_id)
        if sled is None:
            raise bus.NotFound(f"no simulated sled {sled_id!r}")
        return sled


async def command_loop(sled: Sled, idle_wait: float, ack_wait: float) -> None:
    """The sled's orders. An idle sled waits `idle_wait` (its inventory interval) for one before asking
    again: thousands of sleds asking every second would load the broker more than all their inventories
    do, and after a broker restart a sled is no later to take its orders than to report.

    A command is acknowledged (when `handle` returns) only once its effect is on the sled's disk: a crash
    after the ack loses nothing, and one before it has the command redelivered, which changes nothing
    it already did (every command is idempotent by VMM id)."""

    async def handle(env: Envelope, body: Any, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        sled.commands.delivered(seq)  # taken only once this returns: the sled has read up to before it
        if not sled.reachable:
            raise bus.Retry("sled is frozen or cut off", delay=1.0)
        if (held := _held_for(sled, msg)) > 0:
            raise bus.Retry("the sled's commands are held (a fault)", delay=held)
        sled.naming = topology.sled_verb(schema_of(body)[0])  # crash point sled-agent:write:vmm.stop...
        try:
            if isinstance(body, VmmEnsure):
                await sled.ensure(body)
            elif isinstance(body, VmmStop):
                await sled.stop(body)
            elif isinstance(body, VmmMigrate):
                await sled.migrate(body)
            elif isinstance(body, VmmDestroy):
                await sled.destroy(body)
        finally:
            sled.naming = None
        sled.commands.took(seq)
        sled.persist()

    durable = topology.sled(sled.sled_id)
    await sled.commands.ask_broker(sled.js, durable.stream, durable.name)
    await bus.Consumer(
        sled.js,
        service=SOURCE,
        **durable.binding,  # never gives up: a frozen sled holds its commands back
        handler=handle,
        expect=(VmmEnsure, VmmStop, VmmMigrate, VmmDestroy),
        verify=lambda subject, body: topology.command_error(subject, schema_of(body)[0]),
        idle_wait=idle_wait,
        ack_wait=ack_wait,
    ).run()


def _held_for(sled: Sled, msg: Msg) -> float:
    """Seconds the command must still wait under a `hold_commands_seconds` fault (0: take it now)."""
    hold = sled.faults.hold_commands_seconds if sled.faults is not None else 0
    left = hold - (time.time() - msg.metadata.timestamp.timestamp()) if hold else 0.0
    if left > 0:
        telemetry.count("sled.fault.command_held")
    return left


async def announce(sled: Sled) -> None:
    """Send a sled's inventory now. If it cannot go (the broker is away, a fault is injected), the next
    timed inventory carries the same news: a reboot, say, has happened all the same, and is answered so."""
    try:
        await sled.publish_inventory()
    except Exception as e:
        log.info("inventory of %s not sent: %s", sled.sled_id, e)


async def inventory_loop(sim: Simulator, interval: float) -> None:
    """Every sled's inventory once an interval, spread evenly over it (a rack of thousands does not
    report in one burst), each sent without waiting for the one before. A sled whose last inventory is
    still on its way skips its turn rather than queue up behind a slow broker."""
    loop = asyncio.get_running_loop()
    sending: dict[str, asyncio.Task[None]] = {}
    while True:
        start = loop.time()
        sleds = list(sim.sleds.values())
        sending = {sled_id: task for sled_id, task in sending.items() if sled_id in sim.sleds}
        for i, sled in enumerate(sleds):
            if (wait := start + interval * i / len(sleds) - loop.time()) > 0:
                await asyncio.sleep(wait)
            if (task := sending.get(sled.sled_id)) is None or task.done():
                sending[sled.sled_id] = asyncio.create_task(announce(sled))
        await asyncio.sleep(max(start + interval - loop.time(), 0.0))


async def serve_control(nc: Any, sim: Simulator) -> None:
    """Simulator control: `rp.sim.faults.set`, `rp.sim.sled.<verb>` (`rp.sim.sled.capacity` among them)
    and `rp.sim.rack.reboot` (request/reply)."""

    async def set_faults(body: SimFaults, msg: Msg) -> dict[str, Any]:
        sled = sim.get(body.sled_id)
        sled.faults = body
        return sled.describe()

    async def sled_list(body: SimSledList, msg: Msg) -> list[dict[str, Any]]:
        return [s.describe() for s in sim.sleds.values()]

    async def reboot(body: SimSledReboot, msg: Msg) -> dict[str, Any]:
        sled = sim.get(body.sled_id)
        sled.reboot()
        await announce(sled)
        return sled.describe()

    async def rack_reboot(body: SimRackReboot, msg: Msg) -> dict[str, Any]:
        sleds = list(sim.sleds.values())
        for sled in sleds:
            sled.reboot(durable=False)
        rack_boots(sim.state_dir, sleds)  # one write for the rack, before any sled is announced
        await asyncio.gather(*(announce(sled) for sled in sleds))
        return {"rebooted": len(sleds)}

    async def freeze(body: SimSledFreeze, msg: Msg) -> dict[str, Any]:
        sled = sim.get(body.sled_id)
        sled.freeze()
        return sled.describe()

    async def thaw(body: SimSledThaw, msg: Msg) -> dict[str, Any]:
        sled = sim.get(body.sled_id)
        sled.thaw()
        await announce(sled)
        return sled.describe()

    async def capacity(body: SimSledCapacity, msg: Msg) -> dict[str, Any]:
        sled = sim.get(body.sled_id)
        sled.set_capacity(body.vcpus, body.ram_bytes)
        await announce(sled)
        return sled.describe()

    async def partition(body: SimSledPartition, msg: Msg) -> dict[str, Any]:
        sled = sim.get(body.sled_id)
        sled.partition(True)
        return sled.describe()

    async def heal(body: SimSledHeal, msg: Msg) -> dict[str, Any]:
        sled = sim.get(body.sled_id)
        sled.partition(False)
        await announce(sled)
        return sled.describe()

    async def remove(body: SimSledRemove, msg: Msg) -> dict[str, Any]:
        described = sim.get(body.sled_id).describe()
        sim.remove(body.sled_id)
        return described

    async def add(body: SimSledAdd, msg: Msg) -> dict[str, Any]:
        sled = await sim.add(body.vcpus, body.ram_bytes)
        sim.start(sled)
        await announce(sled)
        return sled.describe()

    handlers: dict[Any, Any] = {
        SimFaults: set_faults,
        SimSledList: sled_list,
        SimSledReboot: reboot,
        SimRackReboot: rack_reboot,
        SimSledFreeze: freeze,
        SimSledThaw: thaw,
        SimSledCapacity: capacity,
        SimSledPartition: partition,
        SimSledHeal: heal,
        SimSledRemove: remove,
        SimSledAdd: add,
    }
    # remember: a command sent again (its reply lost) gets the first's reply, not a second reboot or sled
    await bus.serve(nc, topology.sim_control(">"), handlers, queue=SOURCE, check_silo=False, remember=1000)


async def main(settings: Settings) -> None:
    nc, _ = await connect_bus(settings, SOURCE, identity="simulator")
    sim = Simulator(settings, timing_of(settings), settings.sim_state)
    await sim.load_or_create()
    for sled in sim.sleds.values():
        sim.start(sled)
    await serve_control(nc, sim)
    await serve_faults(nc, SOURCE)
    await serve_stats(nc, SOURCE)
    log.info("simulating %d sleds: %s", len(sim.sleds), ", ".join(sim.sleds))
    await run_forever(inventory_loop(sim, settings.inventory_interval))
