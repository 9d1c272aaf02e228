"""rackctl reads by its names: every command is one function declared for it (so `grep -rn '"start"'
rackctl/commands` finds `instance start`), and no two of its modules share a name."""

from __future__ import annotations

import inspect
from collections import Counter
from pathlib import Path

import rackctl.main  # noqa: F401  (registers every command)
from rackctl.commands.base import COMMANDS

ROOT = Path(__file__).resolve().parent.parent


def test_each_command_is_a_function_of_its_own() -> None:
    runs = [c.run for c in COMMANDS.values()]
    assert all(inspect.iscoroutinefunction(r) and "<locals>" not in r.__qualname__ for r in runs), [
        " ".join(w) for w, c in COMMANDS.items() if not inspect.iscoroutinefunction(c.run)
    ]
    shared = [name for name, n in Counter(f"{r.__module__}.{r.__qualname__}" for r in runs).items() if n > 1]
    assert shared == [], f"one function registered for several commands: {shared}"


def test_each_command_is_declared_where_its_words_are_written() -> None:
    for words, c in COMMANDS.items():
        source = inspect.getsource(inspect.getmodule(c.run))  # type: ignore[arg-type]
        assert f'"{" ".join(words)}"' in source, f"rackctl {' '.join(words)} is not spelled in its module"


def test_no_two_rackctl_modules_share_a_name() -> None:
    names = Counter(p.name for p in (ROOT / "rackctl").rglob("*.py") if p.name != "__init__.py")
    assert [n for n, count in names.items() if count > 1] == []
