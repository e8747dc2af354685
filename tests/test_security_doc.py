"""docs/security.md links each rule to its test: every test it names exists."""

from __future__ import annotations

import re

from gpushare.paths import repo_root

REPO = repo_root()
DOC = REPO / "docs" / "security.md"
FULL = re.compile(r"`(tests/[\w/]+\.py)::(\w+)")
PREFIX = re.compile(r"\(`(tests/[\w/]+\.py)::`\)")
BARE = re.compile(r"`(test_\w+)`")


def _named_tests() -> list[tuple[str, str]]:
    named: list[tuple[str, str]] = []
    prefix: str | None = None
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            prefix = None
        if line.startswith("|") and (m := PREFIX.search(line)):
            prefix = m.group(1)  # a table whose test column names its file in the header
            continue
        named += FULL.findall(line)
        if prefix is not None and line.startswith("|"):
            named += [(prefix, name) for name in BARE.findall(line)]
    return named


def test_every_test_the_threat_model_names_exists() -> None:
    named = _named_tests()
    assert len(named) > 40, "the rules' table lost its tests"
    missing = []
    for path, name in named:
        file = REPO / path
        if not file.is_file() or not re.search(rf"^\s*def {name}\(", file.read_text(), re.M):
            missing.append(f"{path}::{name}")
    assert missing == [], "docs/security.md names tests that do not exist"
