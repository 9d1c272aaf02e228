"""rackctl's help and shell integration, offline: every command shows examples that parse, `--version`
says what it is, and `rackctl completion bash`, sourced in bash, completes what is typed."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rackctl.commands.base import COMMANDS
from rackctl.main import EXAMPLES, build_parser
from shared.messages import registry

ROOT = Path(__file__).resolve().parent.parent


def rackctl(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "rackctl.main", *args], capture_output=True, text=True, env=env, timeout=60
    )


def command_lines(examples: tuple[str, ...]) -> list[list[str]]:
    """The rackctl invocations of examples: their comment and any redirection left out."""
    lines = []
    for example in examples:
        words = shlex.split(example.partition("  # ")[0])
        if words[0] == "rackctl":
            lines.append(words[1 : words.index(">") if ">" in words else None])
    return lines


def test_every_command_has_examples_that_parse() -> None:
    parser = build_parser()
    for words, cmd in COMMANDS.items():
        assert cmd.examples, f"rackctl {' '.join(words)} has no examples"
        lines = command_lines(cmd.examples)
        assert lines, f"rackctl {' '.join(words)}: no example runs rackctl"
        for argv in lines:
            args = parser.parse_args(argv)
            assert args.command is cmd, f"{argv} runs {args.command.words}, not {words}"
    for argv in command_lines(EXAMPLES):
        parser.parse_args(argv)


def test_help_ends_with_the_examples_as_written() -> None:
    done = rackctl("instance", "start", "--help")
    assert done.returncode == 0
    tail = done.stdout.split("examples:\n", 1)[1]
    first = COMMANDS[("instance", "start")].examples[0].partition("  # ")[0]
    assert f"  $ {first}\n" in tail
    group = rackctl("instance", "--help").stdout
    assert (
        "examples:" in group and "$ rackctl instance create" in group and "$ rackctl instance stop" in group
    )
    assert "examples:" in rackctl("--help").stdout


def test_version_names_the_package_and_the_schemas() -> None:
    done = rackctl("--version")
    assert done.returncode == 0
    first, schemas = done.stdout.splitlines()
    assert first.startswith("rackctl 0.1.0")
    names = {schema for schema, _ in registry()}
    assert schemas.startswith(f"message schemas: {len(names)} (v1: {len(names)}")
    info = json.loads(rackctl("version", "--json").stdout)
    assert info["version"] == "0.1.0" and set(info["schemas"]) == names
    assert info["schemas"]["rp.cmd.instance.create"] == [1]
    assert sum(len(v) for v in info["schemas"].values()) == len(registry())


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_completion_bash_sourced_in_bash_completes_a_command(tmp_path: Path) -> None:
    """argcomplete's own way: the completion function run with COMP_LINE and COMP_POINT as bash sets
    them, its answer read from COMPREPLY."""
    exe = tmp_path / "rackctl"
    exe.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m rackctl.main "$@"\n')
    exe.chmod(0o755)
    script = r"""
        source <(rackctl completion bash)
        complete_line() {
            COMP_LINE="$1"; COMP_POINT=${#COMP_LINE}; COMP_TYPE=9
            read -r -a COMP_WORDS <<< "$COMP_LINE"
            [[ "$COMP_LINE" == *" " ]] && COMP_WORDS+=("")
            COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
            COMPREPLY=()
            _python_argcomplete rackctl
            printf '%s|' "${COMPREPLY[@]}"; echo
        }
        complete_line "rackctl inst"
        complete_line "rackctl instance st"
        complete_line "rackctl completion z"
        complete_line "rackctl instance start --wa"
    """
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    replies = [sorted(w.strip() for w in line.split("|") if w) for line in done.stdout.splitlines()]
    assert replies == [["instance"], ["start", "stop"], ["zsh"], ["--wait"]], done.stdout


def test_a_bad_log_level_is_one_line_naming_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rackctl.main", "version"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "RACKCTL_LOG": "loud"},
        timeout=60,
    )
    assert done.returncode == 1
    assert (
        done.stderr
        == "rackctl: error: RACKCTL_LOG='loud': expected DEBUG, INFO, WARNING, ERROR or CRITICAL\n"
    )


def test_completion_zsh_registers_with_compdef() -> None:
    done = rackctl("completion", "zsh")
    assert done.returncode == 0
    assert done.stdout.startswith("#compdef rackctl") and "compdef _python_argcomplete rackctl" in done.stdout
    bad = rackctl("completion", "fish")
    assert bad.returncode == 2 and "invalid choice: 'fish'" in bad.stderr
