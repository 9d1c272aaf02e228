"""`rackctl completion`: the shell code that completes rackctl's commands, options and names as typed.

The completions come from rackctl's own parser (argcomplete): the shell runs rackctl with the line typed
so far, and `rackctl.main` answers before it parses anything. The shell code binds every name a user
types rackctl by (`rackctl`, `.venv/bin/rackctl` as the README runs it, and the path of the script that
printed it), and the checkout's interpreter for `python -m rackctl` (`.venv/bin/python`, and the one that
printed it): a line of that interpreter that runs `-m rackctl` is completed by rackctl, told by
argcomplete's own convention (`_ARGCOMPLETE=3`) that its words begin after `-m rackctl`; any other line of
it is left to the shell's default completion. A bare `python` or `python3` is not bound (that would take
over the completion of every Python command line in the shell): argcomplete's global completion
(`activate-global-python-argcomplete`) completes `python -m rackctl` there, since rackctl/__main__.py
carries its marker. Silo, project and instance names are asked of the control plane with the current
context, within a second, and an error completes nothing rather than printing anything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import argcomplete

from rackctl.client import Client
from rackctl.commands.base import Invocation, command
from shared.messages import InstanceList

SHELLS = ("bash", "zsh")
ASK_WITHIN = 1.0
"""A completion must not hang the shell: the whole question, connection included, in a second."""


def executables() -> list[str]:
    """Every name the completion binds: the bare name, the checkout's venv script (relative, as the README
    types it), and the script that is running now (absolute), when rackctl runs as a script."""
    names = ["rackctl", ".venv/bin/rackctl", "./.venv/bin/rackctl"]
    script = Path(sys.argv[0])
    if script.name == "rackctl":
        names.append(str(script.resolve()) if script.exists() else str(script))
    return list(dict.fromkeys(names))


def interpreters() -> list[str]:
    """The interpreters whose `-m rackctl` lines the completion binds: the checkout's venv (relative, as
    one types it from the checkout), and the interpreter running now when rackctl runs as a module."""
    names = [f"{d}.venv/bin/{py}" for py in ("python", "python3") for d in ("", "./")]
    if Path(sys.argv[0]).name == "__main__.py":
        names.append(sys.executable)
    return list(dict.fromkeys(names))


PYTHON_M = r"""
# `python -m rackctl`: a line of these interpreters that runs `-m rackctl` is completed by rackctl
# (_ARGCOMPLETE=3: its words begin after `-m rackctl`); any other is left to the shell's default.
_python_argcomplete_rackctl_module() {
    if [[ -n "${ZSH_VERSION-}" ]]; then
        if [[ "${words[2]-}" != -m || "${words[3]-}" != rackctl || $CURRENT -le 3 ]]; then
            _default
            return
        fi
        local IFS=$'\013'
        local completions
        completions=($(IFS="$IFS" \
            COMP_LINE="$BUFFER" \
            COMP_POINT="$CURSOR" \
            _ARGCOMPLETE=3 \
            _ARGCOMPLETE_SHELL="zsh" \
            _ARGCOMPLETE_SUPPRESS_SPACE=1 \
            __python_argcomplete_run "${words[1]}" -m rackctl))
        local nospace=()
        if [[ "${completions-}" =~ ([^\\\\]): && "${match[1]}" =~ [=/:] ]]; then
            nospace=(-S '')
        fi
        _describe "${words[1]}" completions "${nospace[@]}"
    else
        if [[ "${COMP_WORDS[1]-}" != -m || "${COMP_WORDS[2]-}" != rackctl || $COMP_CWORD -le 2 ]]; then
            COMPREPLY=()
            return
        fi
        local IFS=$'\013'
        local SUPPRESS_SPACE=0
        if compopt +o nospace 2> /dev/null; then
            SUPPRESS_SPACE=1
        fi
        COMPREPLY=($(IFS="$IFS" \
            COMP_LINE="$COMP_LINE" \
            COMP_POINT="$COMP_POINT" \
            COMP_TYPE="$COMP_TYPE" \
            _ARGCOMPLETE_COMP_WORDBREAKS="$COMP_WORDBREAKS" \
            _ARGCOMPLETE=3 \
            _ARGCOMPLETE_SHELL="bash" \
            _ARGCOMPLETE_SUPPRESS_SPACE=$SUPPRESS_SPACE \
            __python_argcomplete_run "$1" -m rackctl))
        if [[ $? != 0 ]]; then
            unset COMPREPLY
        elif [[ $SUPPRESS_SPACE == 1 ]] && [[ "${COMPREPLY-}" =~ [=/:]$ ]]; then
            compopt -o nospace
        fi
    fi
}
if [[ -z "${ZSH_VERSION-}" ]]; then
    complete -o nospace -o default -o bashdefault -F _python_argcomplete_rackctl_module %(interpreters)s
else
    compdef _python_argcomplete_rackctl_module %(interpreters)s
fi
"""
"""Shell code for `python -m rackctl`, after argcomplete's (whose `__python_argcomplete_run` it uses)."""


def shellcode(shell: str) -> str:
    """argcomplete's code for the rackctl scripts, then the code for the interpreters' `-m rackctl`."""
    python_m = PYTHON_M % {"interpreters": " ".join(shlex.quote(i) for i in interpreters())}
    return argcomplete.shellcode(executables(), shell=shell) + python_m


def _shell_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")


@command(
    "completion",
    "print the shell code that completes rackctl's commands, options and names (bash or zsh)",
    _shell_arg,
    examples=(
        "rackctl completion bash > ~/.local/share/bash-completion/completions/rackctl  # bash, for good",
        'source <(rackctl completion bash)  # bash, this shell only (zsh: the same with "zsh")',
        "rackctl completion zsh > ~/.zfunc/_rackctl  # zsh, with ~/.zfunc in $fpath before compinit",
    ),
)
async def completion(ctx: Invocation) -> None:
    print(shellcode(ctx.args.shell), end="")


# --- names, asked of the control plane --------------------------------------------------------------------


async def _names(prefix: str, depth: int, args: argparse.Namespace) -> list[str]:
    """Names at the level `prefix` has reached (silo, then project, then instance), each level but the
    last ending in `/` so that the shell goes on into it."""
    client = await Client.connect(
        getattr(args, "nats", None) or os.environ.get("NATS_URL") or None,
        timeout=ASK_WITHIN,
        connect_within=ASK_WITHIN,
        context=getattr(args, "context", None),
    )
    try:
        parts = prefix.split("/")
        level = min(len(parts), depth)
        if level == 1:
            found = [s["name"] for s in await client.silo_list()]
        elif level == 2:
            found = [f"{parts[0]}/{p['name']}" for p in await client.project_list(parts[0])]
        else:
            views = await client.every(InstanceList(silo=parts[0], project=parts[1]))
            found = [f"{parts[0]}/{parts[1]}/{v['name']}" for v in views]
        more = "/" if level < depth else ""
        return [f + more for f in found if (f + more).startswith(prefix)]
    finally:
        with contextlib.suppress(Exception):
            await client.close()


async def _names_within(prefix: str, depth: int, parsed_args: argparse.Namespace) -> list[str]:
    async with asyncio.timeout(ASK_WITHIN * 2):
        return await _names(prefix, depth, parsed_args)


def names_completer(depth: int) -> Callable[..., list[str]]:
    """An argcomplete completer for SILO (1), SILO/PROJECT (2) or SILO/PROJECT/INSTANCE (3)."""

    def complete(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
        try:
            return asyncio.run(_names_within(prefix, depth, parsed_args))
        except Exception:  # a completion that fails completes nothing, silently
            return []

    return complete


COMPLETERS = {"SILO": 1, "SILO/PROJECT": 2, "SILO/PROJECT/INSTANCE": 3}
"""The depth of name each metavar takes; rackctl.main gives those arguments a names_completer."""
