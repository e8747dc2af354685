"""control/ stays pure: no I/O modules, no clock, no imports of the outside-world packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CONTROL = Path(__file__).resolve().parents[2] / "gpushare" / "control"
BANNED_MODULES = {
    "os",
    "time",
    "subprocess",
    "socket",
    "datetime",
    "threading",
    "asyncio",
    "random",
    "pathlib",
    "shutil",
    "signal",
    "io",
}
BANNED_PACKAGES = ("gpushare.node", "gpushare.daemon", "gpushare.sim", "gpushare.cli")
# Path arithmetic that never touches the file system (a pipe directory's last part).
ALLOWED_FROM = {("pathlib", "PurePosixPath")}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and not all((node.module, a.name) in ALLOWED_FROM for a in node.names)
        ):
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted(CONTROL.glob("*.py")), ids=lambda p: p.name)
def test_control_module_imports_nothing_impure(path: Path) -> None:
    for name in imported_modules(path):
        assert name.split(".")[0] not in BANNED_MODULES, f"{path.name} imports {name}"
        assert not name.startswith(BANNED_PACKAGES), f"{path.name} imports {name}"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    calls = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert not calls & {"open", "print", "input", "exec", "eval"}, f"{path.name}: {calls}"


def test_the_check_sees_the_modules() -> None:
    names = {p.name for p in CONTROL.glob("*.py")}
    assert {"controller.py", "admission.py", "baselines.py", "registry.py"} <= names
    assert {"placement.py", "adoption.py", "pods.py"} <= names


def test_a_pure_path_is_allowed_and_a_path_is_not(tmp_path: Path) -> None:
    pure = tmp_path / "pure.py"
    pure.write_text("from pathlib import PurePosixPath\n")
    impure = tmp_path / "impure.py"
    impure.write_text("from pathlib import Path, PurePosixPath\n")
    assert imported_modules(pure) == set()
    assert imported_modules(impure) == {"pathlib"}
