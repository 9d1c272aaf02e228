"""`rackctl subscriber`: services that follow the events (billing, a dashboard, a tenant's automation),
each with an identity, a stream and a context of its own (deploy/subscribers.py).

These change the broker's identities, so they run where the identities folder is (`make run`'s
`.rackplane/identities`, or `--identities DIR`) and reload the broker through its pid file; they reach it
with the current context's address.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from deploy import identities, subscribers
from rackctl import context as contexts
from rackctl.commands.args import json_flag, silo_path
from rackctl.commands.base import Failure, Invocation, Unconfirmed, UsageError, command, group
from rackctl.output import print_table
from shared.topology import subjects

group("subscriber", "services that follow the events: an identity and a stream each")


def _rack_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--identities",
        type=Path,
        metavar="DIR",
        help="the identities folder (default: $RACKPLANE_IDENTITIES, else $RACKPLANE_HOME/identities, "
        "else .rackplane/identities)",
    )
    p.add_argument(
        "--pid-file",
        type=Path,
        metavar="FILE",
        help="the broker's pid file, to reload it (default: nats/nats.pid beside the identities folder)",
    )


def _name(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", type=silo_path, metavar="NAME", help="the subscriber's name")


def _rack(ctx: Invocation) -> subscribers.Rack:
    a = ctx.args
    folder = a.identities or contexts.identities_dir()
    if not (folder / "identities.json").exists():
        raise UsageError(f"no identities folder at {folder} (give --identities DIR)")
    current = contexts.load(a.context)
    url = a.nats or (current.url if current else None)
    if not url:
        raise UsageError("no broker address: give --nats URL or a context")
    pid_file = a.pid_file or folder.parent / "nats" / "nats.pid"
    return subscribers.Rack(
        identities.Store.load(folder),
        url,
        current.ca if current else None,
        subscribers.reload_by_pid_file(pid_file),
        _replicas(folder.parent / "stack.json"),
    )


def _replicas(manifest: Path) -> int | None:
    """As many copies of a new subscriber's stream as the broker has nodes, when the stack beside the
    identities says (`make run HA=1`'s stack.json); else (None) RACKPLANE_STREAM_REPLICAS, or one."""
    try:
        procs = json.loads(manifest.read_text())["processes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    nodes = sum(1 for p in procs if isinstance(p, dict) and p.get("role") == "nats")
    return nodes if nodes > 1 else None


def _context_identity(name: str) -> str | None:
    """Whose context `contexts/<name>.json` is (`default` is the operator's own), or None if there is none."""
    path = contexts.path_of(name)
    if name == contexts.DEFAULT:
        return "the operator's default context"
    try:
        return str(json.loads(path.read_text()).get("identity") or path)
    except (OSError, ValueError, AttributeError):
        return None


def _write_context(rack: subscribers.Rack, identity: identities.Identity) -> Path:
    return contexts.write(
        identity.name,
        contexts.ConnectionContext(
            url=rack.url,
            nkey=str(rack.store.seed_file(identity.name)),
            ca=rack.ca,
            identity=identity.name,
            stream=subjects.subscriber_stream(identity.name),
            silo=subscribers.scope(identity),
        ),
    )


async def _run(call: Any) -> Any:
    """The step, its refusals as one-line failures."""
    try:
        return await call
    except (ValueError, LookupError, RuntimeError) as e:
        raise Failure(str(e)) from None


def _add_options(p: argparse.ArgumentParser) -> None:
    _name(p)
    p.add_argument("--silo", type=silo_path, metavar="SILO", help="follow only this silo's events")
    _rack_options(p)


@command(
    "subscriber add",
    "make a subscriber: its identity, its stream of events and its context",
    _add_options,
    json_flag,
    examples=(
        "rackctl subscriber add billing  # every event of the fleet",
        "rackctl subscriber add acme-dashboard --silo acme  # acme's events only",
    ),
)
async def subscriber_add(ctx: Invocation) -> None:
    if (other := _context_identity(ctx.args.name)) not in (None, ctx.args.name):
        raise Failure(
            f"a context named {ctx.args.name!r} already exists, for {other}: pick another subscriber name"
        )
    rack = _rack(ctx)
    identity = await _run(subscribers.add(rack, ctx.args.name, ctx.args.silo))
    path = _write_context(rack, identity)
    data = {
        "name": identity.name,
        "silo": subscribers.scope(identity),
        "stream": subjects.subscriber_stream(identity.name),
        "context": str(path),
    }
    ctx.emit(
        data,
        lambda d: print(
            f"subscriber {d['name']} follows {('silo ' + d['silo']) if d['silo'] else 'the fleet'} on "
            f"stream {d['stream']}; context {d['context']} "
            f"(rackctl --context {d['name']} events follow)"
        ),
    )


@command(
    "subscriber list",
    "list the subscribers, their scope and what their streams hold",
    _rack_options,
    json_flag,
    examples=("rackctl subscriber list",),
)
async def subscriber_list(ctx: Invocation) -> None:
    rows = await subscribers.describe(_rack(ctx))
    ctx.emit(
        rows,
        lambda rs: print_table(
            ("NAME", "SILO", "STREAM", "EVENTS", "CONSUMERS"),
            [(r["name"], r["silo"] or "(fleet)", r["stream"], r["events"], r["consumers"]) for r in rs],
        ),
    )


def _name_and_rack(p: argparse.ArgumentParser) -> None:
    _name(p)
    _rack_options(p)


@command(
    "subscriber rotate",
    "a new key for a subscriber (same seed file): the old one is refused from the reload on",
    _name_and_rack,
    json_flag,
    examples=("rackctl subscriber rotate billing",),
)
async def subscriber_rotate(ctx: Invocation) -> None:
    rack = _rack(ctx)
    try:
        path = subscribers.rotate(rack, ctx.args.name)
    except (LookupError, RuntimeError) as e:
        raise Failure(str(e)) from None
    ctx.emit(
        {"name": ctx.args.name, "nkey": str(path)},
        lambda d: print(f"rotated {d['name']}: hand {d['nkey']} to the subscriber"),
    )


def _remove_options(p: argparse.ArgumentParser) -> None:
    _name_and_rack(p)
    p.add_argument("--yes", action="store_true", help="confirm: its stream and its consumers go with it")


@command(
    "subscriber remove",
    "remove a subscriber: its identity, its stream and its context",
    _remove_options,
    json_flag,
    examples=("rackctl subscriber remove billing --yes",),
)
async def subscriber_remove(ctx: Invocation) -> None:
    if not ctx.args.yes:
        raise Unconfirmed(
            f"removing {ctx.args.name} deletes its stream and its consumers: add --yes to go ahead"
        )
    rack = _rack(ctx)
    await _run(subscribers.remove(rack, ctx.args.name))
    if _context_identity(ctx.args.name) == ctx.args.name:  # the subscriber's own, not another's
        contexts.path_of(ctx.args.name).unlink()
    ctx.emit({"name": ctx.args.name}, lambda d: print(f"removed subscriber {d['name']}"))
