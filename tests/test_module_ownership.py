"""One module per outside resource: only ``gpushare/node/mps/`` runs the MPS control binary.

pynvml and cuda-python are imports, so ruff's ``banned-api`` guards them (pyproject.toml). The MPS
binary is a program, which no import rule sees: this test reads every module of the package and
fails when one outside ``gpushare/node/mps/`` both names the binary (``mps.control_binary`` or an
``nvidia-cuda-mps`` literal) and can start a process (``subprocess``, ``gpushare.node.exec``,
``os.exec*``/``spawn*``/``system``/``popen``, asyncio subprocesses). Such a module must ask the MPS
package instead (``find_binary``, ``binary_status``, :class:`MpsNodeManager`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpushare"
MPS_PACKAGE = PACKAGE / "node" / "mps"
SPAWN_MODULES = ("subprocess", "gpushare.node.exec", "asyncio.subprocess")
OS_SPAWNERS = ("exec", "spawn", "posix_spawn", "system", "popen", "fork")
ASYNC_SPAWNERS = ("create_subprocess_exec", "create_subprocess_shell")


def names_mps_binary(tree: ast.AST) -> list[str]:
    """Where the module names the MPS binary: the config field or the binary's name."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "control_binary":
            found.append(f"line {node.lineno}: .control_binary")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "nvidia-cuda-mps" in node.value
            # A docstring or a message that names the binary for a person (it has spaces) runs
            # nothing; an argv element or a default binary name has none.
            and " " not in node.value.strip()
        ):
            found.append(f"line {node.lineno}: {node.value[:40]!r}")
    return found


def can_spawn(tree: ast.AST) -> list[str]:
    """Where the module can start a process."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {a.name}"
                for a in node.names
                if a.name.startswith(SPAWN_MODULES)
            ]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(SPAWN_MODULES):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            elif node.module == "gpushare.node" and any(a.name == "exec" for a in node.names):
                found.append(f"line {node.lineno}: from gpushare.node import exec")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "os" and node.attr.startswith(OS_SPAWNERS):
                found.append(f"line {node.lineno}: os.{node.attr}")
            if node.value.id == "asyncio" and node.attr in ASYNC_SPAWNERS:
                found.append(f"line {node.lineno}: asyncio.{node.attr}")
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if MPS_PACKAGE not in p.parents)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_mps_package_runs_the_mps_binary(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    named = names_mps_binary(tree)
    spawns = can_spawn(tree)
    assert not (named and spawns), (
        f"{path.relative_to(PACKAGE)} names the MPS binary ({named[0]}) and can start processes "
        f"({spawns[0]}): run MPS through gpushare.node.mps (docs/design.md §3)"
    )


def test_the_check_sees_the_mps_package_run_it() -> None:
    # The detectors must see the real thing, or the test above passes by seeing nothing.
    tree = ast.parse((MPS_PACKAGE / "commands.py").read_text(encoding="utf-8"))
    assert names_mps_binary(tree)
    assert can_spawn(tree)
    supervisor = ast.parse((MPS_PACKAGE / "supervisor.py").read_text(encoding="utf-8"))
    assert can_spawn(supervisor)


@pytest.mark.parametrize(
    "source",
    [
        "import subprocess\ndef f(cfg):\n    subprocess.run([cfg.mps.control_binary])\n",
        "from gpushare.node.exec import run\nrun(['nvidia-cuda-mps-control'], timeout_s=1)\n",
        "import os\nos.execvp('nvidia-cuda-mps-control', ['x'])\n",
    ],
)
def test_the_check_catches_a_module_running_it(source: str) -> None:
    tree = ast.parse(source)
    assert names_mps_binary(tree)
    assert can_spawn(tree)


def test_a_message_naming_the_binary_is_not_running_it() -> None:
    tree = ast.parse('"""Talks to nvidia-cuda-mps-control."""\nimport subprocess\n')
    assert not names_mps_binary(tree)
