"""A small async client for rackplane's operator commands; `rackctl` and the tests use it."""

from __future__ import annotations

import asyncio
import os
import random
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from nats.aio.client import Client as NATS

from rackctl import context as contexts
from shared import bus, subjects
from shared.config import DEFAULT_NATS_URL
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
    Paged,
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
    schema_of,
)

SOURCE = "rackctl"
RETRY_AFTER = re.compile(r"\bretry after (\d+) ms\b")
RETRIED = ("limited", "busy")
"""Refusals that say when to come back: a command past its silo's or identity's rate (`limited`), or one
instance-manager has no room for yet (`busy`); neither did anything, so sending it again is safe."""
JITTER = 0.5
"""A retry waits the time it was told plus up to this fraction more, at random: callers limited together
do not all come back in the same millisecond."""
ATTEMPT_SHARE, ATTEMPT_MOST = 0.5, 12.0
"""One send waits at most this share of the client's timeout for its reply (the rest is for sending it
again), and never longer than ATTEMPT_MOST seconds: a service answers every command it holds within 10 s
(instance-manager answers a saga still running then, `commands.SAGA_REPLY_WAIT`), so a reply not come
by 12 s was lost, and waiting longer (rackctl's timeout is 60 s) only delays the resend."""
NO_SERVICE_FOR = 5.0
"""Seconds a command that no service answers (no subscriber at all: a single process restarting, or no
stack) is sent again before the client says so: long enough for a process to come back, short enough
that `rackctl` against a stack that is not running fails at once, not after its whole timeout."""
RESEND_FIRST, RESEND_MOST = 0.1, 2.0
"""Seconds before the first resend of a command whose reply did not come, doubled at each, up to the
most (jitter added): a broker node or a replica being replaced is back within seconds."""
RECONNECT_POLL = 0.2
"""How often a send in flight looks whether the connection was replaced (its reply would be lost)."""


def resend_after(n: int) -> float:
    """Seconds to wait before the `n`th resend (from 0) of a command whose reply did not come."""
    return min(RESEND_FIRST * 2**n, RESEND_MOST) * (1 + random.uniform(0, JITTER))


def retry_after(e: bus.CommandError) -> float | None:
    """Seconds to wait before sending a refused command again (jitter included), or None if it is not to
    be sent again."""
    m = RETRY_AFTER.search(e.message) if e.code in RETRIED else None
    return None if m is None else int(m[1]) / 1000 * (1 + random.uniform(0, JITTER))


class Client:
    def __init__(self, nc: NATS, timeout: float = 15.0) -> None:
        self.nc = nc
        self.timeout = timeout
        self.told_busy = 0
        """Commands told `busy` at least once (and sent again): what a burst's caller reports."""
        self.resent = 0
        """Commands sent again at least once because their reply did not come."""
        self.attempt_share = ATTEMPT_SHARE
        """The share of `timeout` one send waits for its reply (ATTEMPT_SHARE)."""

    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        timeout: float = 15.0,
        connect_within: float = 2.0,
        context: str | None = None,
    ) -> Client:
        """Connect with the credential of `context` (by default $RACKCTL_CONTEXT, else the `default`
        context that `make run` writes: see rackctl/context.py); `url` overrides the context's URL."""
        ctx = contexts.load(context)
        url = url or os.environ.get("NATS_URL") or (ctx.url if ctx else DEFAULT_NATS_URL)
        nc = await bus.connect(
            url,
            SOURCE,
            retry_for=connect_within,
            seed_file=ctx.nkey if ctx else None,
            inbox_prefix=subjects.inbox_prefix(ctx.identity) if ctx and ctx.identity else None,
            ca_file=ctx.ca if ctx else None,
        )
        return cls(nc, timeout)

    async def close(self) -> None:
        await self.nc.drain()

    async def call(self, subject: str, body: Model) -> Any:
        """Send a command and return its reply's data, for as long as the client's timeout, counted from
        the first send. One refused with `retry after N ms` is sent again after that time (with jitter); a
        `busy` one says so on stderr, once a command (instance-manager has more sagas than it can run).
        One whose reply did not come (none in time, no service subscribed while one is being replaced,
        the connection replaced meanwhile) is sent again, with the same envelope id, after a short
        backoff: every command is safe to send again (the services recognise the id: a command takes
        effect once, and its copy gets its answer). That says so on stderr too, once a command. Refusals
        (`conflict`, `not_found`, `stale`, ...) are answers, never sent again; `unavailable` from a service
        that cannot reach its database right now is sent again likewise (its transaction may or may not
        have committed: the copy finds out)."""
        first = time.monotonic()
        deadline = first + self.timeout
        request_id = uuid.uuid4()
        said_busy = said_resent = False
        resends = 0
        while True:
            try:
                return await self._send_once(subject, body, request_id, deadline)
            except bus.CommandError as e:
                if not isinstance(e, bus.NoReply) and e.code != "unavailable":
                    wait = self._retry_or_raise(e, deadline, said_busy)
                    said_busy = said_busy or e.code == "busy"
                    await asyncio.sleep(wait)
                    continue
                wait = resend_after(resends)
                resends += 1
                no_service = isinstance(e, bus.NoReply) and e.code == "unavailable"  # no subscriber
                if time.monotonic() + wait >= (
                    min(deadline, first + NO_SERVICE_FOR) if no_service else deadline
                ):
                    if e.code == "timeout":  # the whole wait, not the last send's
                        raise bus.NoReply(
                            "timeout", f"no reply on {subject} within {self.timeout:g}s"
                        ) from None
                    raise
                if not said_resent:
                    said_resent = True
                    self.resent += 1
                    print(f"{e.message}: sending it again, as the same request", file=sys.stderr)
            await asyncio.sleep(wait)

    def _retry_or_raise(self, e: bus.CommandError, deadline: float, said_busy: bool) -> float:
        """Seconds to wait before sending again a command refused with `retry after N ms`; raise `e` if it
        said no such thing, or if that would pass the deadline. A `busy` one says so, once a command."""
        wait = retry_after(e)
        if wait is None or time.monotonic() + wait > deadline:
            raise e
        if e.code == "busy" and not said_busy:  # once a command: a burst's caller sees why it waits
            self.told_busy += 1
            print(f"instance-manager busy: retrying in {wait * 1000:.0f} ms", file=sys.stderr)
        return wait

    async def _send_once(self, subject: str, body: Model, request_id: uuid.UUID, deadline: float) -> Any:
        """One send, waiting `attempt_share` of the timeout at most (what is left, if less); NoReply `lost`
        as soon as the connection is replaced while it waits (a reply meant for the old one is gone)."""
        wait = max(min(deadline - time.monotonic(), self.timeout * self.attempt_share, ATTEMPT_MOST), 0.01)
        reconnects = self.nc.stats["reconnects"]
        send = asyncio.ensure_future(
            bus.request(self.nc, subject, body, source=SOURCE, timeout=wait, request_id=request_id)
        )
        try:
            while not send.done():
                await asyncio.wait({send}, timeout=RECONNECT_POLL)
                if not send.done() and self.nc.stats["reconnects"] != reconnects:
                    raise bus.NoReply("lost", f"the connection was replaced while {subject} was out")
            return send.result()
        finally:
            if not send.done():
                send.cancel()

    async def pages(self, body: Paged) -> AsyncIterator[list[Any]]:
        """A list command's items, a page at a time (each page one request, in the list's order)."""
        while True:
            page = await self.send(body)
            yield page["items"]
            if page["next"] is None:
                return
            body = body.model_copy(update={"after": page["next"]})

    async def every(self, body: Paged) -> list[Any]:
        """All of a list command's items, through every page."""
        return [item async for page in self.pages(body) for item in page]

    async def send(self, body: Model) -> Any:
        """Send an operator command on the subject its schema and silo name (`rp.cmd.<silo>.<schema's
        resource>.<verb>`), for callers that built and validated the body themselves."""
        resource, verb = schema_of(body)[0].removeprefix("rp.cmd.").split(".")
        return await self.call(subjects.command(getattr(body, "silo", None), resource, verb), body)

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
