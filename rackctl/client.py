"""A small async client for rackplane's operator commands; `rackctl` and the tests use it. How a command
is sent, resent and retried is rackctl/sender.py's; here, one method per command."""

from __future__ import annotations

import asyncio
from typing import Any

from rackctl.sender import NO_SERVICE_FOR, SOURCE, CommandSender
from shared import bus
from shared.messages import (
    AutoRestart,
    InstanceCreate,
    InstanceDelete,
    InstanceList,
    InstanceMigrate,
    InstanceShow,
    InstanceStart,
    InstanceStop,
    Model,
    PoolCreate,
    PoolDelete,
    PoolList,
    PoolResize,
    PoolShow,
    ProjectCreate,
    ProjectDelete,
    ProjectList,
    Quota,
    ServiceFaults,
    SiloCreate,
    SiloDelete,
    SiloLimitsSet,
    SiloList,
    SiloShow,
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
    SledExpunge,
    SledList,
    StatsGet,
    UsageGet,
    UsageHistoryGet,
)
from shared.topology import subjects

__all__ = ["NO_SERVICE_FOR", "Client"]


class Client(CommandSender):
    """One method per operator command, each building its request and sending it (`CommandSender.call`)."""

    # --- silos and projects ---

    async def silo_create(self, name: str, quota: Quota | None = None) -> Any:
        return await self.call(
            subjects.command(None, "silo", "create"), SiloCreate(name=name, quota=quota or Quota())
        )

    async def silo_list(self) -> Any:
        return await self.every(SiloList())

    async def silo_show(self, name: str) -> Any:
        """The silo, its quota, and its tenant limits with what it holds of each (`used`)."""
        return await self.send(SiloShow(silo=name))

    async def silo_limits(self, body: SiloLimitsSet) -> Any:
        """Set a silo's tenant limits (the fleet operator's command, on `_fleet`): the silo as shown after."""
        return await self.call(subjects.command(None, "silo", "limits"), body)

    async def project_create(self, silo: str, name: str) -> Any:
        return await self.call(
            subjects.command(silo, "project", "create"), ProjectCreate(silo=silo, name=name)
        )

    async def project_list(self, silo: str) -> Any:
        return await self.every(ProjectList(silo=silo))

    async def silo_delete(self, name: str) -> Any:
        """Delete a silo that holds no project (the fleet operator's command, on `_fleet`)."""
        return await self.call(subjects.command(None, "silo", "delete"), SiloDelete(name=name))

    async def project_delete(self, silo: str, name: str) -> Any:
        """Delete a project that holds no instance and no pool."""
        return await self.send(ProjectDelete(silo=silo, name=name))

    # --- instances ---

    async def instance_create(
        self,
        silo: str,
        project: str,
        name: str,
        *,
        vcpus: int,
        ram_bytes: int,
        disk_bytes: int,
        auto_restart: AutoRestart = AutoRestart.best_effort,
    ) -> Any:
        body = InstanceCreate(
            silo=silo,
            project=project,
            name=name,
            vcpus=vcpus,
            ram_bytes=ram_bytes,
            disk_bytes=disk_bytes,
            auto_restart=auto_restart,
        )
        return await self.send(body)

    async def instance_from_pool(
        self,
        silo: str,
        project: str,
        name: str,
        pool: str,
        *,
        require: bool = False,
        auto_restart: AutoRestart = AutoRestart.best_effort,
    ) -> Any:
        """Take an idle VM of the pool (reply `source`: "pool"), or a new one ("new") unless `require`."""
        body = InstanceCreate(
            silo=silo,
            project=project,
            name=name,
            from_pool=pool,
            require_pool=require,
            auto_restart=auto_restart,
        )
        return await self.send(body)

    async def pool_create(
        self, silo: str, project: str, name: str, *, size: int, vcpus: int, ram_bytes: int, disk_bytes: int
    ) -> Any:
        body = PoolCreate(
            silo=silo,
            project=project,
            name=name,
            size=size,
            vcpus=vcpus,
            ram_bytes=ram_bytes,
            disk_bytes=disk_bytes,
        )
        return await self.send(body)

    async def pool(self, verb: str, silo: str, project: str, name: str, **extra: int) -> Any:
        """show, resize (size=) or delete one pool."""
        model: type[Model] = {"show": PoolShow, "resize": PoolResize, "delete": PoolDelete}[verb]
        return await self.call(
            subjects.command(silo, "pool", verb), model(silo=silo, project=project, name=name, **extra)
        )

    async def pool_list(self, silo: str | None = None, project: str | None = None) -> Any:
        return await self.every(PoolList(silo=silo, project=project))

    async def instance(self, verb: str, silo: str, project: str, name: str) -> Any:
        """start, stop, delete or show one instance."""
        model = {
            "start": InstanceStart,
            "stop": InstanceStop,
            "delete": InstanceDelete,
            "show": InstanceShow,
        }[verb]
        return await self.call(
            subjects.command(silo, "instance", verb), model(silo=silo, project=project, name=name)
        )

    async def instance_migrate(self, silo: str, project: str, name: str, to_sled: str | None = None) -> Any:
        """Move a running instance to `to_sled` (or the least loaded sled with room): the instance as the
        move began, with `migration` naming its source and target."""
        return await self.send(InstanceMigrate(silo=silo, project=project, name=name, to_sled=to_sled))

    async def instance_list(self, silo: str | None = None, project: str | None = None) -> Any:
        return await self.every(InstanceList(silo=silo, project=project))

    # --- fleet ---

    async def sled_list(self) -> Any:
        return await self.every(SledList())

    async def usage(self, silo: str | None = None, project: str | None = None) -> Any:
        return await self.call(subjects.command(silo, "usage", "get"), UsageGet(silo=silo, project=project))

    async def usage_history(
        self,
        silo: str | None = None,
        project: str | None = None,
        since_seconds: int = 86400,
        buckets: int = 120,
    ) -> Any:
        body = UsageHistoryGet(silo=silo, project=project, since_seconds=since_seconds, buckets=buckets)
        return await self.call(subjects.command(silo, "usage", "history"), body)

    async def sled_expunge(self, sled_id: str) -> Any:
        return await self.call(subjects.command(None, "sled", "expunge"), SledExpunge(sled_id=sled_id))

    async def sim_sled(self, verb: str, sled_id: str | None = None, **shape: int) -> Any:
        """Drive the simulator: list, add (vcpus=, ram_bytes=), reboot, freeze, thaw or remove a sled."""
        model: type[Model] = {
            "list": SimSledList, "add": SimSledAdd, "reboot": SimSledReboot, "freeze": SimSledFreeze,
            "thaw": SimSledThaw, "remove": SimSledRemove, "partition": SimSledPartition, "heal": SimSledHeal,
        }[verb]  # fmt: skip
        body = model(**shape) if verb in ("list", "add") else model(sled_id=sled_id)
        return await self.call(subjects.sim_control(f"sled.{verb}"), body)

    async def sim_rack_reboot(self) -> Any:
        """Reboot every simulated sled at once (a power loss of the whole rack)."""
        return await self.call(subjects.sim_control("rack.reboot"), SimRackReboot())

    async def stats(self, service: str) -> Any:
        return await self.call(subjects.stats(service), StatsGet())

    async def sim_faults(self, faults: SimFaults) -> Any:
        return await self.call(subjects.sim_control("faults.set"), faults)

    # --- fault injection (testing only) ---

    async def faults(self, service: str, body: ServiceFaults | None = None) -> Any:
        """Set a service's faults (`body`), or only read them: `{service, active, faults, counters, ...}`."""
        return await self.call(subjects.faults(service), body or ServiceFaults())

    async def faults_status(self, timeout: float = 2.0) -> list[dict[str, Any]]:
        """Every service's faults, asked at once; a service that does not answer has `error` instead."""

        async def one(service: str) -> dict[str, Any]:
            try:
                return await bus.request(
                    self.nc, subjects.faults(service), ServiceFaults(), source=SOURCE, timeout=timeout
                )
            except bus.CommandError as e:
                return {"service": service, "error": e.message}

        return list(await asyncio.gather(*(one(s) for s in subjects.SERVICES)))

    async def clear_faults(self) -> None:
        """Turn every service's faults off (tests call it when done, whatever happened)."""
        for service in subjects.SERVICES:
            await self.faults(service, ServiceFaults(clear=True))
