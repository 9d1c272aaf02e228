"""A sled's state across simulator restarts.

A sled keeps its state (boot number and id, VMMs) in a small file, so that a restart of the simulator
process is not a reboot of its sleds: same boot, same VMMs. The boot number only grows, by one at each
reboot, and every report and inventory carries it with a sequence number within the boot, so that a
receiver can tell an old message (a redelivery from before a reboot) from a new one; the boot id alone
could only say "different". The sled also keeps its boot history, the hardware's own record of when each
boot began, which the invariant checker holds the control plane's failures against. Changes are written
in batches (one write covers every change of the last few milliseconds, as a database's group commit
does), and a report leaves only once the state it reports is on disk: a sled never reports what a restart
would make it forget. A command is acknowledged only once its effect is on disk too (`persist`, before
the ack: a crash after the ack loses nothing, one before it has the command redelivered, and every
command is idempotent by VMM id). A reboot is something else: a new boot, and every VMM gone, without a
word about them (a real sled does not report what it lost). A rack-wide reboot writes every sled's new
boot in one file (`rack_boots`), not 5,000: each sled's own file catches up with its next change, and
loading takes the newer boot of the two.

"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from nats.aio.client import Client as NATS

from services.sled_agent.taken import CommandsTaken
from services.sled_agent.vmm import SimVmm, Timing
from shared.crash import crash_point
from shared.messages import VmmReport, VmmState

if TYPE_CHECKING:
    from services.sled_agent.sled import Sled

SAVE_BATCH = 0.02
"""Seconds a state change waits for others to share its write."""
REMEMBERED_BOOTS = 100
RACK_BOOTS = "rack-boots.json"
"""The new boot of every sled of the last rack-wide reboot, beside the sleds' own files."""


class Persistence:
    """Writing a sled's state (in batches, or at once) and loading it back; part of `Sled` (sled.py)."""

    sled_id: str
    vcpus: int
    ram_bytes: int
    state_dir: Path | None
    boot_id: uuid.UUID
    boot_number: int
    boots: list[dict[str, Any]]
    seq: int
    seq_reserved: int
    vmms: dict[uuid.UUID, SimVmm]
    ended: dict[uuid.UUID, None]
    unsent: dict[uuid.UUID, VmmReport]
    capacity_vcpus: int | None
    capacity_ram_bytes: int | None
    commands: CommandsTaken
    naming: str | None
    _changes: int
    _saved: int
    _on_disk: asyncio.Event
    _named: set[str]
    _writer: asyncio.Task[None] | None
    _report: Callable[[SimVmm], None]
    _send: Callable[[VmmReport], None]
    _spawn: Callable[[Any], None]
    _transition: Callable[..., None]
    _resume_hand_over: Callable[[SimVmm], bool]
    _finish_start: Callable[[SimVmm], Any]
    _finish_stop: Callable[[SimVmm], Any]
    _await_handover: Callable[[SimVmm], Any]

    def _save(self, now: bool = False, name: str | None = None) -> None:
        """Count a state change; write it with the next batch (`now`: before returning)."""
        self._changes += 1
        if (name := name or self.naming) is not None and self.state_dir is not None:
            self._named.add(name)  # a command's verb, `handover-target`, `handover-source`
        if self.state_dir is None:
            self._saved = self._changes
        elif now:
            self._write()
        elif self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_batches())

    async def _write_batches(self) -> None:
        while self._saved < self._changes:
            await asyncio.sleep(SAVE_BATCH)
            self._write()

    def persist(self) -> None:
        """Write every change so far now, if any is not on disk yet: what a command did, before its ack.
        Not batched: the sled takes one command at a time, so a batch would only delay the ack."""
        if self.state_dir is not None and self._saved < self._changes:
            self._write()

    async def _durable(self, change: int) -> None:
        while self._saved < change:
            self._on_disk.clear()
            await self._on_disk.wait()

    def _write(self) -> None:
        assert self.state_dir is not None
        change = self._changes
        for name in self._named:  # every named change so far: this write carries them all
            crash_point(f"sled-agent:write:{name}")
        self._named.clear()
        state = {
            "sled_id": self.sled_id,
            "vcpus": self.vcpus,
            "ram_bytes": self.ram_bytes,
            "capacity": [self.capacity_vcpus, self.capacity_ram_bytes],
            "boot_id": str(self.boot_id),
            "boot_number": self.boot_number,
            "seq_reserved": self.seq_reserved,
            "boots": self.boots,
            "commands_read": self.commands.last,
            "vmms": [
                {
                    "vmm_id": str(v.vmm_id),
                    "instance_id": str(v.instance_id),
                    "vcpus": v.vcpus,
                    "ram_bytes": v.ram_bytes,
                    "state": v.state.value,
                    "generation": v.generation,
                    "since": v.since,
                    "migrate_from": str(v.migrate_from) if v.migrate_from else None,
                    "target_sled_id": v.target_sled_id,
                    "target_vmm_id": str(v.target_vmm_id) if v.target_vmm_id else None,
                }
                for v in self.vmms.values()
            ],
            "ended": [str(v) for v in self.ended],
            "unsent": [r.model_dump_json() for r in self.unsent.values()],
        }
        _replace(self.state_dir / f"{self.sled_id}.json", state)
        self._saved = change
        self._on_disk.set()

    def boot_record(self) -> dict[str, Any]:
        return {**self.boots[-1], "seq_reserved": self.seq_reserved}

    @classmethod
    def load(cls, path: Path, nc: NATS, timing: Timing, rack_boot: dict[str, Any] | None = None) -> Self:
        """The sled as its file left it, or, if the last rack-wide reboot (`rack_boot`, from rack_boots)
        came after that file was written, as that reboot left it."""
        state = json.loads(path.read_text())
        if rack_boot is not None and rack_boot["number"] > state.get("boot_number", 1):
            ended = [v["vmm_id"] for v in state["vmms"]]
            state |= {
                "boot_id": rack_boot["boot_id"],
                "boot_number": rack_boot["number"],
                "seq_reserved": rack_boot["seq_reserved"],
                "boots": [
                    *state.get("boots", []),
                    {k: rack_boot[k] for k in ("number", "boot_id", "started_at")},
                ][-REMEMBERED_BOOTS:],
                "vmms": [],
                "ended": [*state["ended"], *ended],
            }
        sled = cls(state["sled_id"], state["vcpus"], state["ram_bytes"], nc, timing, path.parent)
        sled.boot_id = uuid.UUID(state["boot_id"])
        sled.boot_number = state.get("boot_number", 1)
        sled.seq = sled.seq_reserved = state.get("seq_reserved", 0)  # never reuse one handed out before
        sled.boots = state.get("boots") or sled.boots
        sled.capacity_vcpus, sled.capacity_ram_bytes = state.get("capacity") or (None, None)
        sled.commands.last = state.get("commands_read")
        for v in state["vmms"]:
            vmm = SimVmm(
                uuid.UUID(v["vmm_id"]),
                uuid.UUID(v["instance_id"]),
                v["vcpus"],
                v["ram_bytes"],
                VmmState(v["state"]),
                v["generation"],
                uuid.UUID(v["migrate_from"]) if v.get("migrate_from") else None,
                target_sled_id=v.get("target_sled_id"),
                target_vmm_id=uuid.UUID(v["target_vmm_id"]) if v.get("target_vmm_id") else None,
            )
            vmm.since = v.get("since", vmm.since)
            sled.vmms[vmm.vmm_id] = vmm
        sled.ended = {uuid.UUID(v): None for v in state["ended"]}
        reports = (VmmReport.model_validate_json(r) for r in state.get("unsent", []))
        sled.unsent = {r.vmm_id: r for r in reports}
        return sled

    def resume(self) -> None:
        """After a simulator restart: finish what was under way, and report every VMM's state again. Every
        sled is loaded before any resumes: a migration source looks at its target's sled. The reports of
        VMMs that ended and that the broker had not acknowledged go again first, as they were."""
        for report in list(self.unsent.values()):
            self._send(report)
        for vmm in list(self.vmms.values()):
            if vmm.state is VmmState.migrating and vmm.target_vmm_id is not None:
                if self._resume_hand_over(vmm):
                    continue  # ended, and reported so
            self._report(vmm)
            if vmm.state is VmmState.starting:
                self._spawn(self._finish_start(vmm))
            elif vmm.state is VmmState.stopping:
                self._spawn(self._finish_stop(vmm))
            elif vmm.state is VmmState.migrating and vmm.migrate_from is not None:
                self._spawn(self._await_handover(vmm))
            elif vmm.state is VmmState.migrating and vmm.target_vmm_id is None:
                self._transition(vmm, VmmState.running)  # a file from before targets were kept: run on


def rack_boots(state_dir: Path | None, sleds: list[Sled]) -> None:
    """Write the new boot of every sled of a rack-wide reboot, in one file (each sled's own file follows
    with its next change): a simulator restarted in between still knows every sled rebooted."""
    if state_dir is None:
        return
    _replace(state_dir / RACK_BOOTS, {s.sled_id: s.boot_record() for s in sleds})


def read_rack_boots(state_dir: Path) -> dict[str, dict[str, Any]]:
    path = state_dir / RACK_BOOTS
    return json.loads(path.read_text()) if path.exists() else {}


def _replace(path: Path, state: dict[str, Any]) -> None:
    """Write `state` as the whole of `path`, or not at all (a crash mid-write leaves the old file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
