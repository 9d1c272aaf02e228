"""docs/asyncapi.yaml as a client author's tooling reads it: the official AsyncAPI parser (npm
`@asyncapi/parser`, pinned in tests/asyncapi/package.json) finds no error and no warning in it, and every
payload compiles as the JSON Schema 2020-12 its `schemaFormat` says it is. The drift test
(tests/test_contract.py) says the file is what the code writes; this one says what it writes is valid.

The parser is installed into tests/asyncapi/node_modules (ignored by git) by `npm ci` the first time, some
10 seconds, and reused after while it matches package-lock.json. Skipped, with the reason, where node or
npm is absent or the npm registry cannot be reached for that install. By hand:
`node tests/asyncapi/check.mjs docs/asyncapi.yaml`.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy import schemas
from shared import contract
from shared.messages import registry
from tests.npm import npm_ci

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tests" / "asyncapi"


@pytest.fixture(scope="module")
def node() -> str:
    """node, with the pinned parser installed beside check.mjs (or the test is skipped, saying why)."""
    return npm_ci(CHECK, "the AsyncAPI parser check (tests/asyncapi)")


def _check(node: str, document: Path) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [node, str(CHECK / "check.mjs"), str(document)], capture_output=True, text=True, timeout=120
    )
    print(r.stdout, r.stderr)  # every diagnostic, shown when the test fails
    return r


def test_the_asyncapi_document_passes_the_official_parser_with_no_error_and_no_warning(node: str) -> None:
    r = _check(node, schemas.ASYNCAPI)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = r.stdout.splitlines()[-1]
    assert re.match(r"@asyncapi/parser \S+: 0 errors, 0 warnings, ", summary), summary
    payloads = len(registry()) + 1  # every message schema, and the reply
    assert summary.endswith(f"; {payloads} payloads compiled as JSON Schema 2020-12"), summary


def test_the_parser_check_fails_on_a_warning_and_on_a_payload_that_is_no_2020_12_schema(
    node: str, tmp_path: Path
) -> None:
    """The check is as strict as it says: a warning fails it (the recommended rules speak of AsyncAPI 2
    documents only, so a 2.6 one without `info.contact` makes one), and so does a payload whose schema
    its own 2020-12 format refuses."""
    old = {"asyncapi": "2.6.0", "info": {"title": "t", "version": "1", "description": "d"}, "channels": {}}
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    r = _check(node, tmp_path / "old.yaml")
    assert r.returncode == 1 and re.search(r"^warning asyncapi-info-contact ", r.stdout, re.M), r.stdout

    doc = yaml.safe_load(schemas.ASYNCAPI.read_text())
    (tmp_path / "schemas").mkdir()
    for schema in schemas.SCHEMAS.glob("*.json"):
        (tmp_path / "schemas" / schema.name).write_text(schema.read_text())
    broken = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "record"}
    (tmp_path / "schemas" / contract.REPLY_FILE).write_text(json.dumps(broken))
    (tmp_path / "asyncapi.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    r = _check(node, tmp_path / "asyncapi.yaml")
    assert r.returncode == 1 and "not a valid JSON Schema 2020-12" in r.stdout, r.stdout
    assert "reply" in r.stdout and ", 0 warnings" in r.stdout.splitlines()[-1]
