"""What every command module shares: the command table, the `Invocation` a command runs with, its errors.

A command is one function registered with `@command("group verb", ...)`; `rackctl.main` builds the parser
from that table, so a new command group is a new module of functions, not parser code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import ValidationError

from rackctl.client import Client
from rackctl.output import TableStream, print_json
from rackctl.sizes import format_size
from shared.messages import Model, Paged

CONNECT_TIMEOUT = 5.0
M = TypeVar("M", bound=Model)


class UsageError(Exception):
    """A mistake in the command line found after parsing (exit 2, like argparse's own errors)."""


class Failure(Exception):
    """The command ran but did not get what it asked for: a failed instance, a wait that timed out."""


class Unconfirmed(Exception):
    """An irreversible command without `--yes`: refused before touching anything (exit 2, one line)."""


class UnknownName(Exception):
    """A silo or project on the command line that does not exist, for a command that reads the database
    rather than asking a service (exit 2, one line)."""


# --- the command table -----------------------------------------------------------------------------------


@dataclass
class Invocation:
    """One run of a command, what it runs with: its arguments, a lazily connected client, and its own
    deadline. (A rackctl context, rackctl/context.py, is where it connects; nats's JetStreamContext is the
    broker's API.)"""

    args: argparse.Namespace
    started: float = field(default_factory=time.monotonic)
    _client: Client | None = None

    async def client(self) -> Client:
        """Connect on first use, so that usage errors are reported before (and without) any network."""
        if self._client is None:
            limit = min(CONNECT_TIMEOUT, self.args.timeout)
            self._client = await Client.connect(
                self.args.nats, timeout=self.args.timeout, connect_within=limit, context=self.args.context
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):  # a broken connection must not hold the exit up
                async with asyncio.timeout(2.0):
                    await self._client.close()

    @property
    def remaining(self) -> float:
        return self.started + self.args.timeout - time.monotonic()

    def emit(self, data: Any, human: Callable[[Any], None]) -> None:
        """The reply as JSON with --json, else as people read it."""
        if getattr(self.args, "json", False):
            print_json(data)
        else:
            human(data)


"""The name `Invocation` had before; kept for command modules not renamed yet."""

Runner = Callable[[Invocation], Awaitable[None]]
Option = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]
    help: str
    run: Runner
    options: tuple[Option, ...]
    examples: tuple[str, ...] = ()
    """Whole command lines (`rackctl ...`), each optionally followed by `  # what it does`."""


COMMANDS: dict[tuple[str, ...], Command] = {}
GROUPS: dict[str, str] = {}
"""Help of each command group, by its words."""


def command(
    words: str, help: str, *options: Option, examples: tuple[str, ...] = ()
) -> Callable[[Runner], Runner]:
    """Register `run` as `rackctl <words>`, with the arguments that `options` add to its parser and the
    `examples` its help ends with (tests/test_cli_help.py parses every one)."""

    def register(run: Runner) -> Runner:
        key = tuple(words.split())
        COMMANDS[key] = Command(key, help, run, options, tuple(examples))
        return run

    return register


def epilog(examples: tuple[str, ...] | list[str]) -> str | None:
    """The `examples:` section of a help text, as a shell would show it: each command line, after the
    comment that says what it does."""
    if not examples:
        return None
    out = ["examples:"]
    for line in examples:
        cmd, _, why = line.partition("  # ")
        out += ([f"  # {why}"] if why else []) + [f"  $ {cmd}"]
    return "\n".join(out)


def group(words: str, help: str) -> None:
    """Give the command group `rackctl <words>` its help."""
    GROUPS[words] = help


# --- requests and replies --------------------------------------------------------------------------------


def validated(model: type[M], options: dict[str, str], **fields: Any) -> M:
    """Build the request here, so that an out-of-range value is a usage error naming the option."""
    try:
        return model(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else "request"
        option = options.get(name, name)
        bounds = err.get("ctx") or {}
        show = format_size if name.endswith("_bytes") else str
        if "ge" in bounds:
            raise UsageError(f"{option} must be at least {show(bounds['ge'])}") from None
        if "le" in bounds:
            raise UsageError(f"{option} must be at most {show(bounds['le'])}") from None
        raise UsageError(f"{option}: {err['msg']}") from None


SHAPE_OPTIONS = {"vcpus": "--cpus", "ram_bytes": "--ram", "disk_bytes": "--disk"}
"""The options that give a VM's shape, by the request field they fill."""


async def emit_pages(
    ctx: Invocation, body: Paged, headers: tuple[str, ...], row: Callable[[dict[str, Any]], tuple[Any, ...]]
) -> None:
    """A list, page by page: a table that starts with the first page, or (--json) the whole list."""
    client = await ctx.client()
    if getattr(ctx.args, "json", False):
        print_json(await client.every(body))
        return
    table = TableStream(headers)
    async for page in client.pages(body):
        table.write([row(item) for item in page])
    table.close()


def view_path(v: dict[str, Any]) -> str:
    """The `SILO/PROJECT/NAME` of an instance or pool view."""
    return f"{v['silo']}/{v['project']}/{v['name']}"


def shape_text(v: dict[str, Any]) -> str:
    cpus = f"{v['vcpus']} vCPU" + ("" if v["vcpus"] == 1 else "s")
    return f"{cpus}, {format_size(v['ram_bytes'])} RAM, {format_size(v['disk_bytes'])} disk"
