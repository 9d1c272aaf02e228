"""docs/architecture.md's "Where things are" names every module of the product: a newcomer finds each
file there, and a file added without a line of its own fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("services", "shared", "rackctl", "deploy")
IGNORED = {"__init__.py", "__main__.py"}


def layout_rows() -> dict[str, str]:
    """The table's rows: folder (as written, e.g. `services/accounting/`) -> what the row says."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and (m := re.fullmatch(r"`([\w/.]+/)`", cells[0])):
            rows[m.group(1)] = "|".join(cells[1:])
    return rows


def unnamed_modules() -> list[str]:
    """Every module of the product that its folder's row does not name (in backticks)."""
    rows = layout_rows()
    missing = []
    for top in FOLDERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name in IGNORED or "migrations" in path.parent.parts or "__pycache__" in path.parts:
                continue
            folder = path.parent.relative_to(ROOT).as_posix() + "/"
            if folder not in rows:
                missing.append(f"{path.relative_to(ROOT)} (no row for {folder})")
            elif f"`{path.name}`" not in rows[folder]:
                missing.append(str(path.relative_to(ROOT)))
    return missing


def test_every_module_has_its_line_in_the_architecture() -> None:
    assert unnamed_modules() == []
