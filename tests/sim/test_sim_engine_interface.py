"""The simulator's engine modules share declared interfaces, not each other's private names.

The five modules compiled together (``gpushare.sim.engine.COMPILED``) reach each other's state
only through public, documented fields and methods (``Gpu``'s interface is listed on the class):
no module reads ``something._name`` except on ``self``. And their run-time imports form no cycle
(``gpu`` imports the others; they import it under ``TYPE_CHECKING`` only, for its types).
"""

from __future__ import annotations

import ast
from pathlib import Path

from gpushare.sim import engine

SIM_DIR = Path(engine.__file__).parent


def private_reads(source: str) -> list[str]:
    """``expr._name`` (not dunder) anywhere in ``source`` where ``expr`` is not ``self``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def runtime_imports(source: str, package: str) -> set[str]:
    """Modules of ``package`` imported at run time (not under ``if TYPE_CHECKING:``)."""
    names: set[str] = set()
    for node in ast.parse(source).body:  # top level only: a TYPE_CHECKING block is an If
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(package + "."):
                names.add(node.module.removeprefix(package + "."))
            elif node.module == package:
                names.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(package + "."):
                    names.add(a.name.removeprefix(package + "."))
    return names


def has_cycle(graph: dict[str, set[str]]) -> bool:
    """Whether the directed graph has a cycle (depth-first, three colours)."""
    state: dict[str, int] = {}

    def visit(n: str) -> bool:
        state[n] = 1
        for m in graph.get(n, ()):
            if state.get(m) == 1 or (m not in state and visit(m)):
                return True
        state[n] = 2
        return False

    return any(n not in state and visit(n) for n in graph)


def test_no_engine_module_reads_another_objects_private_names() -> None:
    found = {
        m: reads
        for m in engine.COMPILED
        if (reads := private_reads((SIM_DIR / f"{m}.py").read_text()))
    }
    assert found == {}


def test_engine_modules_import_each_other_without_a_cycle() -> None:
    graph = {
        m: runtime_imports((SIM_DIR / f"{m}.py").read_text(), "gpushare.sim") & set(engine.COMPILED)
        for m in engine.COMPILED
    }
    assert not has_cycle(graph), graph
    assert graph["gpu"] >= {"dispatch", "waves", "events", "timeslice"}


def test_the_checks_see_a_private_read_and_a_cycle() -> None:
    src = "def f(gpu):\n    x = 1\n    return gpu._fair\n"
    assert private_reads(src) == ["3: gpu._fair"]
    assert private_reads("class A:\n    def f(self):\n        return self._x\n") == []
    typed = (
        "from typing import TYPE_CHECKING\n"
        "from gpushare.sim.waves import arm_waves\n"
        "if TYPE_CHECKING:\n    from gpushare.sim.gpu import Gpu\n"
    )
    assert runtime_imports(typed, "gpushare.sim") == {"waves"}
    assert has_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}})
    assert not has_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()})
