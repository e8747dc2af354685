"""``bench/`` never imports ``tests/``: what a bench shares with the tests lives in ``bench/support/``.

The tests may import ``bench.support`` (real daemons, accounts, trusted directories, faults, the
fake pynvml); the other way round a bench would break whenever a test helper is refactored, and
a bench would run test code nobody measured it with. This test reads every module under
``bench/`` and fails on any ``import tests...`` or ``from tests... import``.
"""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def imports_of_tests(tree: ast.AST) -> list[str]:
    """Where a module imports the ``tests`` package (at any depth, also inside functions)."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {a.name}"
                for a in node.names
                if a.name == "tests" or a.name.startswith("tests.")
            ]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and (node.module == "tests" or node.module.startswith("tests."))
        ):
            found.append(f"line {node.lineno}: from {node.module} import ...")
    return found


def test_the_check_sees_every_form_of_import() -> None:
    code = (
        "import tests.support.x\n"
        "from tests.fakes import y\n"
        "def f():\n    from tests import z\n"
        "import testsuite\nfrom testing import t\n"
    )
    assert imports_of_tests(ast.parse(code)) == [
        "line 1: import tests.support.x",
        "line 2: from tests.fakes import ...",
        "line 4: from tests import ...",
    ]


def test_no_bench_module_imports_tests() -> None:
    modules = sorted(BENCH.rglob("*.py"))
    assert len(modules) > 20, f"found only {len(modules)} modules under {BENCH}"
    offenders = {
        str(path.relative_to(BENCH.parent)): found
        for path in modules
        if (found := imports_of_tests(ast.parse(path.read_text(), filename=str(path))))
    }
    assert (
        not offenders
    ), f"bench/ imports tests/ (move what it needs to bench/support/): {offenders}"
