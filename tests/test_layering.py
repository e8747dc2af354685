"""The house's rooms, in order: no module imports a room above its own, and packages form no cycle.

docs/design.md §3 ("Rooms") says what each room is for. This test is the rule's one source: it
reads every module of the package (every ``import``, also those inside functions and under
``TYPE_CHECKING``: an arrow is an arrow whenever it runs) and fails when

* a module belongs to no room (a new module must be given one here and in docs/design.md),
* a module imports a module of a higher room (an upward arrow),
* two packages import each other, directly or around a longer circle (a cycle). A package is a
  sub-package of ``gpushare`` (``gpushare.node``) or a top-level module (``gpushare.config``).

A room may import any room below it, not only the one just below: ``sim`` builds on ``daemon``,
``node`` and ``control`` alike.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpushare"

ROOMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # The vocabulary every room shares: types, the config, units, paths, logging, the file trust
    # checks, the MPS environment, the socket's client (what apps import) and the metrics exporter.
    (
        "base",
        (
            "gpushare",
            "gpushare.units",
            "gpushare.paths",
            "gpushare.logs",
            "gpushare.trust",
            "gpushare.model",
            "gpushare.protocol",
            "gpushare.tomlschema",
            "gpushare.config",
            "gpushare.stats",
            "gpushare.mpsenv",
            "gpushare.shipped",
            "gpushare.client",
            "gpushare.metrics",
            "gpushare.metrics_http",
        ),
    ),
    # Pure rules: no I/O, no clock (tests/control/test_control_purity.py).
    ("rules", ("gpushare.control",)),
    # The outside world, sensors and actuators, one module per resource; app-side signals.
    ("node", ("gpushare.node", "gpushare.latency", "gpushare.native")),
    # The daemon's parts, wired to the Protocols of node/base.py.
    ("daemon", ("gpushare.daemon",)),
    # The simulated node and the runner that drives the daemon's own loop on it.
    ("sim", ("gpushare.sim",)),
    # Composition roots: where real or simulated parts are wired into something that runs.
    ("roots", ("gpushare.roots",)),
    # Entry points: the command line, the Slurm TaskProlog, the installer, the kubelet device plugin.
    (
        "entry",
        ("gpushare.cli", "gpushare.slurm", "gpushare.install", "gpushare.__main__", "gpushare.k8s"),
    ),
)
RANK = {name: i for i, (name, _) in enumerate(ROOMS)}


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str | None:
    """The room whose longest prefix names the module (``gpushare`` alone is the root package)."""
    best: tuple[int, str] | None = None
    for name, prefixes in ROOMS:
        for prefix in prefixes:
            names_it = module == prefix or (
                prefix != "gpushare" and module.startswith(prefix + ".")
            )
            if names_it and (best is None or len(prefix) > best[0]):
                best = (len(prefix), name)
    return None if best is None else best[1]


def package_of(module: str) -> str:
    """``gpushare.node.mps.parse`` -> ``gpushare.node``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports (resolved to modules that exist)."""
    paths = {module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}

    def existing(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_pkg = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join([*here, *([node.module] if node.module else [])])
                # ``from gpushare import config`` imports gpushare.config, not gpushare.
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names
                ]
            else:
                continue
            for name in names:
                if name == "gpushare" or name.startswith("gpushare."):
                    target = existing(name)
                    if target is not None and target != mod:
                        targets.add(target)
        graph[mod] = targets
    return graph


@cache
def package_graph() -> dict[str, set[str]]:
    """The import graph of ``gpushare`` itself, read once per test run."""
    return import_graph(PACKAGE)


def upward_arrows(graph: Mapping[str, set[str]]) -> list[str]:
    found = []
    for mod, targets in sorted(graph.items()):
        mine = room_of(mod)
        for target in sorted(targets):
            theirs = room_of(target)
            if mine is not None and theirs is not None and RANK[theirs] > RANK[mine]:
                found.append(f"{mod} ({mine}) imports {target} ({theirs})")
    return found


def package_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one package (Tarjan), each sorted."""
    arrows: dict[str, set[str]] = defaultdict(set)
    for mod, targets in graph.items():
        for target in targets:
            a, b = package_of(mod), package_of(target)
            if a != b:
                arrows[a].add(b)
    nodes = sorted({package_of(m) for m in graph})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(arrows[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in nodes:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_room() -> None:
    homeless = sorted(m for m in package_graph() if room_of(m) is None)
    assert (
        not homeless
    ), f"give these modules a room (tests/test_layering.py, docs/design.md §3): {homeless}"


def test_no_module_imports_a_higher_room() -> None:
    found = upward_arrows(package_graph())
    assert not found, "upward imports between rooms:\n" + "\n".join(found)


def test_no_cycle_between_packages() -> None:
    found = package_cycles(package_graph())
    assert not found, f"packages that import each other: {found}"


# The checks themselves, on small made-up graphs: each must see what it is for.


def test_the_checks_see_an_upward_arrow_and_a_cycle() -> None:
    graph = {
        "gpushare.daemon.main": {"gpushare.sim.node"},
        "gpushare.sim.runner": {"gpushare.daemon.loop"},
        "gpushare.sim.node": set(),
        "gpushare.daemon.loop": {"gpushare.control.duty"},
        "gpushare.control.duty": set(),
    }
    assert upward_arrows(graph) == ["gpushare.daemon.main (daemon) imports gpushare.sim.node (sim)"]
    assert package_cycles(graph) == [["gpushare.daemon", "gpushare.sim"]]
    del graph["gpushare.daemon.main"]
    assert upward_arrows(graph) == []
    assert package_cycles(graph) == []


def test_the_graph_reads_relative_lazy_and_type_only_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "gpushare"
    (pkg / "daemon").mkdir(parents=True)
    (pkg / "sim").mkdir()
    for d in (pkg, pkg / "daemon", pkg / "sim"):
        (d / "__init__.py").write_text("")
    (pkg / "sim" / "node.py").write_text("X = 1\n")
    (pkg / "daemon" / "loop.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gpushare.sim.node import X\n"
        "def f():\n    from ..sim import node\n"
    )
    graph = import_graph(pkg)
    assert graph["gpushare.daemon.loop"] == {"gpushare.sim.node"}


@pytest.mark.parametrize("room", [name for name, _ in ROOMS])
def test_every_room_holds_modules(room: str) -> None:
    assert any(room_of(m) == room for m in package_graph()), f"room {room} is empty"


DESIGN = PACKAGE.parent / "docs" / "design.md"


def design_table() -> dict[str, str]:
    """docs/design.md's module table: module label (``node/mps/``, ``node/nvml.py``) -> room."""
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("### Every module and its one job", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1].startswith("`") and cells[1].endswith("`"):
            rows[cells[1].strip("`")] = cells[0]
    return rows


def label_of(module: str) -> str:
    """How the table names a module: a package by its folder, the root package by its file."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    path = PACKAGE.joinpath(*parts)
    return "/".join(parts) + "/" if path.is_dir() else "/".join(parts) + ".py"


def test_the_design_lists_every_module_in_its_room() -> None:
    documented = design_table()
    actual = {label_of(m): room_of(m) for m in package_graph()}
    missing = sorted(set(actual) - set(documented))
    gone = sorted(set(documented) - set(actual))
    wrong = sorted(f"{k}: {documented[k]} (is {actual[k]})" for k in set(actual) & set(documented)
                   if documented[k] != actual[k])  # fmt: skip
    assert not (
        missing or gone or wrong
    ), f"docs/design.md §3's module table: add {missing}; remove {gone}; fix the room of {wrong}"


def test_the_design_lists_the_rooms_in_order() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    section = text.split("### Rooms", 1)[1].split("###", 1)[0]
    listed = [
        cells[1]
        for line in section.splitlines()
        if len(cells := [c.strip() for c in line.strip().strip("|").split("|")]) >= 2
        and cells[0].isdigit()
    ]
    assert listed == [name for name, _ in ROOMS]
