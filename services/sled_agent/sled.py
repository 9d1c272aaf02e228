"""One simulated sled: its VMMs' state machines, its reports, and the faults it can be told to inject.

Every VMM change bumps the VMM's generation and is reported; a report is retried until JetStream
acknowledges it, each attempt carrying the VMM's state as it is then. A VMM that reached a terminal state is
remembered, so that a late or repeated `ensure` never brings it back.

The VMMs' state machines and live migration are in vmm.py, the reports and inventories in reports.py,
and the state file kept across simulator restarts in persistence.py; `Sled` holds a sled's state and
what the simulator's operator does to it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from services.sled_agent.persistence import (
    RACK_BOOTS,
    REMEMBERED_BOOTS,
    SAVE_BATCH,
    Persistence,
    rack_boots,
    read_rack_boots,
)
from services.sled_agent.reports import SOURCE, Reporting
from services.sled_agent.taken import CommandsTaken
from services.sled_agent.vmm import REMEMBERED_ENDED, SimVmm, Timing, VmmMachine
from shared import telemetry
from shared.messages import SimFaults, VmmReport

__all__ = [
    "RACK_BOOTS",
    "REMEMBERED_BOOTS",
    "REMEMBERED_ENDED",
    "SAVE_BATCH",
    "SEQ_BLOCK",
    "SOURCE",
    "SimVmm",
    "Sled",
    "Timing",
    "rack_boots",
    "read_rack_boots",
]

log = logging.getLogger(__name__)
SEQ_BLOCK = 10_000
"""Sequence numbers are reserved on disk a block at a time, so that a restarted simulator never reuses one
within a boot without writing its state for every message."""


@dataclass
class Sled(VmmMachine, Reporting, Persistence):
    sled_id: str
    vcpus: int
    ram_bytes: int
    nc: NATS
    """The sled's own connection (its own credential: identity.py)."""
    timing: Timing = field(default_factory=Timing)
    state_dir: Path | None = None
    boot_id: uuid.UUID = field(default_factory=uuid.uuid4)
    boot_number: int = 1
    boots: list[dict[str, Any]] = field(default_factory=list)
    """The boot history: {number, boot_id, started_at} for each boot, oldest first (the last REMEMBERED)."""
    seq: int = 0
    """The last sequence number used in this boot; numbers up to `seq_reserved` may be used unwritten."""
    seq_reserved: int = 0
    vmms: dict[uuid.UUID, SimVmm] = field(default_factory=dict)
    ended: dict[uuid.UUID, None] = field(default_factory=dict)
    unsent: dict[uuid.UUID, VmmReport] = field(default_factory=dict)
    """The reports of VMMs that ended, until the broker acknowledges them (reports.py `_new_report`)."""
    faults: SimFaults | None = None
    capacity_vcpus: int | None = None
    capacity_ram_bytes: int | None = None
    """What the sled reports instead of `vcpus` and `ram_bytes` (made with), if set: rp.sim.sled.capacity."""
    commands: CommandsTaken = field(default_factory=CommandsTaken)
    """How far the sled has taken its command stream (in every inventory; the last one taken is on disk
    with its effect)."""
    peer: Callable[[str], Sled | None] | None = None
    """Another sled by id (None if there is no such sled): where a migration hands over to."""
    frozen: bool = False
    partitioned: bool = False
    _thawed: asyncio.Event = field(default_factory=asyncio.Event)
    _connected: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _changes: int = 0
    """State changes so far; `_saved` of them are on disk."""
    _saved: int = 0
    _on_disk: asyncio.Event = field(default_factory=asyncio.Event)
    naming: str | None = None
    """The name of the changes being made (a command's verb), for the crash points below."""
    _named: set[str] = field(default_factory=set)
    """Names of unwritten changes: the write that carries them passes `sled-agent:write:<name>` first."""
    _writer: asyncio.Task[None] | None = None
    js: JetStreamContext = field(init=False)

    def __post_init__(self) -> None:
        self.js = self.nc.jetstream()
        self._thawed.set()
        self._connected.set()
        if not self.boots:
            self._record_boot()

    def _record_boot(self) -> None:
        started = datetime.now(UTC).isoformat()
        self.boots.append({"number": self.boot_number, "boot_id": str(self.boot_id), "started_at": started})
        del self.boots[:-REMEMBERED_BOOTS]

    def next_seq(self) -> int:
        """The next sequence number of this boot (a block is reserved on disk before its first use)."""
        self.seq += 1
        if self.seq > self.seq_reserved:
            self.seq_reserved = self.seq + SEQ_BLOCK
            if self.state_dir is not None:
                self._write()
        return self.seq

    @property
    def reachable(self) -> bool:
        return not (self.frozen or self.partitioned)

    # --- what the simulator's operator does to a sled ---

    def reboot(self, durable: bool = True) -> None:
        """Every VMM is lost; the sled comes back with a new boot id and nothing running. Written at once,
        for it is announced at once; `durable=False` leaves that to the caller (`rack_boots`)."""
        lost = len(self.vmms)
        self.boot_id = uuid.uuid4()
        self.boot_number += 1
        self.seq, self.seq_reserved = 0, SEQ_BLOCK  # the first block goes with the write below, not its own
        self._record_boot()
        for vmm_id in list(self.vmms):
            self._forget(vmm_id)
        self.vmms.clear()
        if durable:
            self._save(now=True)  # announced at once (its inventory): it must survive a simulator restart
        else:
            self._changes += 1  # on disk with the sled's next change; rack_boots holds it meanwhile
        telemetry.count("sled.reboots")
        log.info(
            "%s rebooted (boot %d, id %s): %d VMMs lost", self.sled_id, self.boot_number, self.boot_id, lost
        )

    def freeze(self) -> None:
        """Stop answering: no inventory, no reports, no commands taken, until thawed."""
        self.frozen = True
        self._thawed.clear()

    def thaw(self) -> None:
        self.frozen = False
        self._thawed.set()

    def partition(self, cut: bool) -> None:
        """Cut the sled off the network (or heal it): its VMMs go on, but nothing goes in or out."""
        self.partitioned = cut
        if cut:
            self._connected.clear()
        else:
            self._connected.set()

    def set_capacity(self, vcpus: int | None, ram_bytes: int | None) -> None:
        """Report this capacity from the next inventory on (None: what the sled was made with), as a sled
        that lost cores or DIMMs, or got them back, would. Written at once: it is announced at once."""
        self.capacity_vcpus, self.capacity_ram_bytes = vcpus, ram_bytes
        self._save(now=True)

    @property
    def reported_vcpus(self) -> int:
        return self.vcpus if self.capacity_vcpus is None else self.capacity_vcpus

    @property
    def reported_ram_bytes(self) -> int:
        return self.ram_bytes if self.capacity_ram_bytes is None else self.capacity_ram_bytes

    def shut_down(self) -> None:
        for t in [*self._tasks, self._writer]:
            if t is not None:
                t.cancel()
        if self.state_dir is not None:
            (self.state_dir / f"{self.sled_id}.json").unlink(missing_ok=True)
            self.state_dir = None  # gone for good: nothing of it is written again

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def describe(self) -> dict[str, Any]:
        return {
            "sled_id": self.sled_id,
            "boot_id": str(self.boot_id),
            "boot_number": self.boot_number,
            "boots": self.boots,
            "vcpus": self.reported_vcpus,
            "ram_bytes": self.reported_ram_bytes,
            "nominal_vcpus": self.vcpus,
            "nominal_ram_bytes": self.ram_bytes,
            "frozen": self.frozen,
            "partitioned": self.partitioned,
            "vmms": len(self.vmms),
            "faults": self.faults.model_dump(mode="json") if self.faults else None,
        }
