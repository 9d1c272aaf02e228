"""rackctl: the operator's command line for rackplane.

Every command is one function registered with `@command("group verb", ...)` in a module of
rackctl/commands/, one per command group; the parser is built here from that table, so a new command
group (pool, sim, chaos, check...) is only a new module of functions, not parser code.

Contract for scripts: exit 0 on success, 1 when the control plane refuses, fails or times out (one line
on stderr: `rackctl: error: ...`), 2 on a usage error (an irreversible command without `--yes`, and a
name an auditing command cannot find, included);
`--json` prints the reply data and nothing else, and turns any error into one JSON object on stderr,
`{"error": {"code": ..., "message": ...}}`, with the same exit code. Global options (`--json`,
`--context`, `--nats`, `--timeout`) go before or after the command words.
Set RACKCTL_LOG=DEBUG to see library logs on stderr (silent by default so errors stay one line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import NoReturn

import argcomplete
import nats.errors

from rackctl import context as contexts

# importing rackctl.commands (its __init__) registers every command, in the order of --help
from rackctl.commands.args import seconds
from rackctl.commands.base import (
    COMMANDS,
    GROUPS,
    Command,
    Failure,
    Invocation,
    Unconfirmed,
    UnknownName,
    UsageError,
    epilog,
)
from rackctl.commands.completion import COMPLETERS, names_completer
from rackctl.commands.version import version_text
from shared import bus, telemetry
from shared.config import DEFAULT_NATS_URL, ConfigError

PROG = "rackctl"
DEFAULT_TIMEOUT = 60.0
EXAMPLES = (
    "rackctl silo create acme --cpus 16 --ram 64GiB  # a silo with quotas",
    "rackctl instance start acme/web/frontend --wait  # start an instance, and wait until it runs",
    "rackctl --json instance list --silo acme  # any read as JSON (global options go anywhere)",
    "rackctl --context acme-operator usage  # as another identity (docs/security.md)",
    "source <(rackctl completion bash)  # complete commands and options as they are typed",
)
FORMAT = argparse.RawDescriptionHelpFormatter
"""Every help keeps its examples' lines as written."""


class _Parser(argparse.ArgumentParser):
    """argparse's own usage errors as JSON on stderr too, when the line asks for `--json`."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        if _Parser.json_errors:
            self.exit(_report(message, "usage", status=2))
        super().error(message)


class _Version(argparse.Action):
    """`--version`: made only when asked, so that parsing (and completing) never runs git."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> NoReturn:
        print(version_text())
        parser.exit()


def _global_options(p: argparse.ArgumentParser, defaults: bool) -> None:
    """On the top parser with defaults; on every command too (suppressed defaults), so both orders work."""
    p.add_argument(
        "--nats",
        metavar="URL",
        default=os.environ.get("NATS_URL") or None if defaults else argparse.SUPPRESS,
        help=f"NATS server (default: $NATS_URL, else the context's, else {DEFAULT_NATS_URL})",
    )
    p.add_argument(
        "--context",
        metavar="NAME",
        default=None if defaults else argparse.SUPPRESS,
        help="whose credential to use: a context name or file (default: $RACKCTL_CONTEXT, else the "
        "`default` context that make run writes; see docs/security.md)",
    )
    p.add_argument(
        "--timeout",
        type=seconds,
        metavar="SECONDS",
        default=DEFAULT_TIMEOUT if defaults else argparse.SUPPRESS,
        help="how long to wait for a reply, and with --wait for the target state "
        f"(default {DEFAULT_TIMEOUT:g})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Operate a rackplane control plane.",
        epilog=epilog(EXAMPLES) + f"\n\n`{PROG} COMMAND --help` shows a command's options and examples.",
        formatter_class=FORMAT,
    )
    parser.add_argument(
        "--version", action=_Version, help="show the version and the message schemas, then exit"
    )
    _global_options(parser, defaults=True)
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the reply data as JSON, and nothing else; errors as JSON on stderr",
    )
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, defaults=False)
    subs = {(): parser.add_subparsers(title="commands", metavar="COMMAND", required=True)}
    leaves: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for words, cmd in COMMANDS.items():
        for i in range(1, len(words)):
            if words[:i] in subs:
                continue
            if (
                words[:i] in leaves
            ):  # a command with commands of its own (`usage`, `usage audit`, `usage history`)
                subs[words[:i]] = leaves[words[:i]].add_subparsers(metavar="COMMAND", required=False)
                continue
            about = GROUPS.get(" ".join(words[:i]))
            group = subs[words[: i - 1]].add_parser(
                words[i - 1],
                help=about,
                description=about,
                epilog=epilog(group_examples(words[:i])),
                formatter_class=FORMAT,
            )
            subs[words[:i]] = group.add_subparsers(metavar="COMMAND", required=True)
        leaf = subs[words[:-1]].add_parser(
            words[-1],
            help=cmd.help,
            description=cmd.help,
            epilog=epilog(cmd.examples),
            formatter_class=FORMAT,
            parents=[common],
        )
        for add in cmd.options:
            add(leaf)
        for action in leaf._actions:
            if action.dest == "json":  # a command's own --json must not reset one given before its words
                action.default = argparse.SUPPRESS
            if isinstance(action.metavar, str) and action.metavar in COMPLETERS:
                action.completer = names_completer(COMPLETERS[action.metavar])  # type: ignore[attr-defined]
        leaf.set_defaults(command=cmd, parser=leaf)
        leaves[words] = leaf
    return parser


def group_examples(words: tuple[str, ...]) -> list[str]:
    """A command group's examples: the first of each of its commands."""
    return [c.examples[0] for w, c in COMMANDS.items() if w[: len(words)] == words and c.examples]


async def run(cmd: Command, args: argparse.Namespace) -> None:
    """One command, as one trace: the client carries this span's context to every service it reaches."""
    ctx = Invocation(args)
    with telemetry.span(f"{PROG} {' '.join(cmd.words)}"):
        try:
            await cmd.run(ctx)
        finally:
            await ctx.close()


def main(argv: list[str] | None = None) -> NoReturn:
    _setup_logging()
    parser = build_parser()
    argcomplete.autocomplete(parser)  # answers a shell's completion request and exits; otherwise nothing
    words = sys.argv[1:] if argv is None else argv
    _Parser.json_errors = "--json" in words[: words.index("--")] if "--" in words else "--json" in words
    args = parser.parse_args(argv)
    _Parser.json_errors = bool(getattr(args, "json", False))
    try:
        telemetry.setup_tracing(PROG)
    except ValueError as e:
        _exit_error(str(e))
    code = 0
    try:
        asyncio.run(run(args.command, args))
    except UsageError as e:
        args.parser.error(str(e))
    except Unconfirmed as e:
        code = _report(str(e), "unconfirmed", status=2)
    except UnknownName as e:
        code = _report(str(e), "unknown_name", status=2)
    except BrokenPipeError:  # stdout closed early (`rackctl ... | head`): not an error worth a line
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    except bus.CommandError as e:
        hint = contexts.denied_hint(args.context) if e.code == "forbidden" else None
        code = _report(f"{e}: {hint}" if hint else str(e), e.code)
    except Failure as e:
        code = _report(str(e), "failed")
    except ConnectionError as e:
        code = _report(str(e), "unreachable")
    except ConfigError as e:
        code = _report(str(e), "config")
    except nats.errors.Error as e:
        code = _report(f"nats: {e}", "nats")
    except KeyboardInterrupt:
        code = 130
    finally:
        telemetry.shutdown_tracing()
    sys.exit(code)


def _report(message: str, code: str = "failed", status: int = 1) -> int:
    """One line on stderr, whatever the message holds: `rackctl: error: ...`, or with --json one JSON object
    (`code` is the service's refusal code, else what kind of failure), so a script never parses prose."""
    text = " ".join(message.split())
    if _Parser.json_errors:
        print(json.dumps({"error": {"code": code, "message": text}}), file=sys.stderr)
    else:
        print(f"{PROG}: error: {text}", file=sys.stderr)
    return status


def _exit_error(message: str) -> NoReturn:
    sys.exit(_report(message))


def _setup_logging() -> None:
    level = os.environ.get("RACKCTL_LOG")
    if level:
        if level.upper() not in logging.getLevelNamesMapping():
            _exit_error(f"RACKCTL_LOG={level!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
        logging.basicConfig(level=level.upper(), format=f"{PROG}: %(levelname)s %(name)s: %(message)s")
    else:  # without a handler, Python would print library warnings (nats reconnects) to stderr
        logging.getLogger().addHandler(logging.NullHandler())


if __name__ == "__main__":
    main()
