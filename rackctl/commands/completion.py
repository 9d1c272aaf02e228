"""`rackctl completion`: the shell code that completes rackctl's commands and options as they are typed.

The completions come from rackctl's own parser (argcomplete): the shell runs rackctl with the line typed
so far, and `rackctl.main` answers before it parses anything.
"""

from __future__ import annotations

import argparse

import argcomplete

from rackctl.commands.base import Ctx, command

SHELLS = ("bash", "zsh")


def _shell_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")


@command(
    "completion",
    "print the shell code that completes rackctl's commands and options (bash or zsh)",
    _shell_arg,
    examples=(
        "rackctl completion bash > ~/.local/share/bash-completion/completions/rackctl  # bash, for good",
        'source <(rackctl completion bash)  # bash, this shell only (zsh: the same with "zsh")',
        "rackctl completion zsh > ~/.zfunc/_rackctl  # zsh, with ~/.zfunc in $fpath before compinit",
    ),
)
async def completion(ctx: Ctx) -> None:
    print(argcomplete.shellcode(["rackctl"], shell=ctx.args.shell), end="")
