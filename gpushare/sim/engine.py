"""Which implementation of the GPU model runs: the compiled one, or the pure-Python source.

``scripts/build-sim-engine.sh`` compiles the GPU model's modules (:data:`COMPILED`) with mypyc in
one invocation, as one group, into ``_native/`` next to this file: a shared library
(:data:`SHARED_LIB`) that holds all their code, so that calls among them stay native, and one
small extension per module that loads it. It records the SHA-256 of every source it compiled
(:func:`record`). The compiled modules are the same code (bit-identical results, several times
faster); :func:`select` puts ``_native/`` first on the package's search path only when the whole
build is there and its record matches the sources now in the tree, so an edit to any of them is
never shadowed by an older build. ``GPUSHARE_SIM_ENGINE=python`` forces the source.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import os
from collections.abc import Mapping, MutableSequence
from dataclasses import dataclass
from pathlib import Path

#: Set to ``python`` to run the pure-Python source even when a current build exists.
ENV_ENGINE = "GPUSHARE_SIM_ENGINE"
#: Where the build script puts the compiled modules.
NATIVE_DIR = Path(__file__).with_name("_native")
#: Where their sources are (this package).
SOURCE_DIR = Path(__file__).parent
#: The modules of :mod:`gpushare.sim` compiled together: the GPU model and its event loop.
COMPILED = ("events", "gpu", "dispatch", "waves", "timeslice")
#: The mypyc group's name; its shared library is ``<last part>__mypyc`` (``gpu__mypyc.<suffix>``).
GROUP = "gpushare.sim.gpu"
SHARED_LIB = GROUP.rsplit(".", 1)[1] + "__mypyc"
#: The build's record of the sources it was compiled from (see :func:`record`).
RECORD = "SOURCE_SHA256"
BUILD_HINT = (
    "the pure-Python engine gives the same results, only slower; nothing to fix (a clone of the "
    "repository builds the compiled one with `make engine`)"
)


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """The engine to load and why: ``kind`` is ``compiled`` or ``python``."""

    kind: str
    reason: str


def record(source_dir: Path = SOURCE_DIR) -> str:
    """The build record of the sources in ``source_dir``: ``<sha256>  <module>.py`` a line.

    One line per compiled module, in :data:`COMPILED` order, as ``sha256sum`` prints them.
    """
    return "".join(
        f"{hashlib.sha256((source_dir / f'{m}.py').read_bytes()).hexdigest()}  {m}.py\n"
        for m in COMPILED
    )


def _changed(recorded: str, current: str) -> list[str]:
    """The sources whose line differs between two records (every one if none does)."""

    def by_file(rec: str) -> dict[str, str]:
        pairs = [line.split("  ", 1) for line in rec.splitlines()]
        return {p[1]: p[0] for p in pairs if len(p) == 2}

    old, new = by_file(recorded), by_file(current)
    return [name for name in new if old.get(name) != new[name]] or list(new)


def choose(
    native_dir: Path = NATIVE_DIR,
    source_dir: Path = SOURCE_DIR,
    env: Mapping[str, str] = os.environ,
) -> EngineChoice:
    """Decide between the build in ``native_dir`` and the source, without importing either."""
    if env.get(ENV_ENGINE, "").strip().lower() == "python":
        return EngineChoice("python", f"{ENV_ENGINE}=python")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    missing = [
        f"{name}{suffix}"
        for name in (SHARED_LIB, *COMPILED)
        if not (native_dir / f"{name}{suffix}").is_file()
    ]
    if len(missing) == len(COMPILED) + 1:
        return EngineChoice("python", f"not built for this Python: {BUILD_HINT}")
    if missing:
        # A module whose extension is missing would load from source next to compiled ones that
        # call into its never-initialised native code.
        return EngineChoice("python", f"incomplete build (no {', '.join(missing)}): {BUILD_HINT}")
    try:
        built_from = (native_dir / RECORD).read_text()
    except OSError:
        return EngineChoice("python", f"build has no {RECORD}: {BUILD_HINT}")
    current = record(source_dir)
    if built_from != current:
        changed = ", ".join(_changed(built_from, current))
        return EngineChoice("python", f"built from another {changed}: {BUILD_HINT}")
    return EngineChoice("compiled", f"mypyc build in {native_dir}")


def select(package_path: MutableSequence[str]) -> EngineChoice:
    """Make the package ``gpushare.sim`` load the chosen engine (before the model is imported)."""
    choice = choose()
    if choice.kind == "compiled" and str(NATIVE_DIR) not in package_path:
        package_path.insert(0, str(NATIVE_DIR))
    return choice


def loaded() -> str:
    """What the imported GPU model really is: ``compiled``, ``python``, or ``mixed`` (never chosen).

    Imports every module of :data:`COMPILED`; one is compiled when it was not loaded from a ``.py``.
    """
    files = [importlib.import_module(f"gpushare.sim.{m}").__file__ for m in COMPILED]
    compiled = sum(1 for f in files if f is not None and not f.endswith(".py"))
    if compiled == len(COMPILED):
        return "compiled"
    return "python" if compiled == 0 else "mixed"
