"""`make schemas` (`python -m deploy.schemas`): the contract (shared/contract.py) written to files, one
JSON Schema per message schema and version (docs/schemas/), the schema of every request's reply
(docs/schemas/reply.json), one example of each message kept for good (docs/schemas/examples/), and the
AsyncAPI 3.0 document (docs/asyncapi.yaml); and what differs between those files and the code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from shared.contract import REPLY_FILE, asyncapi, example, json_schema, reply_schema, schema_file
from shared.messages import registry

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "docs" / "schemas"
ASYNCAPI = ROOT / "docs" / "asyncapi.yaml"
EXAMPLES = SCHEMAS / "examples"
"""One example message per schema and version, written once and never rewritten: the compatibility test
replays every one of them against today's readers, so a change that breaks an old reader's messages fails
even after the schemas are written anew."""


# --- writing and checking the files ---------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """YAML without anchors and aliases (`&id001`, `*id001`), which some readers of AsyncAPI do not
    follow: a list two operations share is written out twice."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def rendered() -> dict[Path, str]:
    """Every file `make schemas` writes, with its content."""
    out = {
        SCHEMAS / schema_file(s, v): json.dumps(json_schema(s, v, m), indent=2, sort_keys=True) + "\n"
        for (s, v), m in sorted(registry().items())
    }
    out[SCHEMAS / REPLY_FILE] = json.dumps(reply_schema(), indent=2, sort_keys=True) + "\n"
    header = "# Written by `make schemas` (python -m deploy.schemas) from the code: do not edit.\n"
    out[ASYNCAPI] = header + yaml.dump(asyncapi(), Dumper=_Dumper, sort_keys=False, width=110)
    return out


def drift() -> list[str]:
    """What differs between the committed files and the code (empty: none)."""
    files = rendered()
    out = [
        f"{p.relative_to(ROOT)} is out of date"
        for p, text in files.items()
        if not p.exists() or p.read_text() != text
    ]
    out += [f"{p.relative_to(ROOT)} has no schema any more" for p in SCHEMAS.glob("*.json") if p not in files]
    return out


def main() -> None:
    EXAMPLES.mkdir(parents=True, exist_ok=True)
    for (s, v), m in sorted(registry().items()):
        kept = EXAMPLES / schema_file(s, v)
        if not kept.exists():
            kept.write_text(json.dumps(example(s, v, m), indent=2, sort_keys=True) + "\n")
    files = rendered()
    for stale in set(SCHEMAS.glob("*.json")) - set(files):
        stale.unlink()
    for path, text in files.items():
        path.write_text(text)
    where = f"{SCHEMAS.relative_to(ROOT)}/ and {ASYNCAPI.relative_to(ROOT)}"
    print(f"wrote {len(files) - 1} JSON Schemas to {where}")


if __name__ == "__main__":
    main()
