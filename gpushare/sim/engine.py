"""Which implementation of the GPU model runs: the compiled one, or the pure-Python source.

``scripts/build-sim-engine.sh`` compiles :mod:`gpushare.sim.gpu` with mypyc into ``_native/`` next
to this file and records the SHA-256 of the ``gpu.py`` it compiled. The compiled module is the same
code (bit-identical results, several times faster); :func:`select` puts ``_native/`` first on the
package's search path only when that record matches the ``gpu.py`` now in the tree, so an edit to
the source is never shadowed by an older build. ``GPUSHARE_SIM_ENGINE=python`` forces the source.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
from collections.abc import Mapping, MutableSequence
from dataclasses import dataclass
from pathlib import Path

#: Set to ``python`` to run the pure-Python source even when a current build exists.
ENV_ENGINE = "GPUSHARE_SIM_ENGINE"
#: Where the build script puts the compiled module.
NATIVE_DIR = Path(__file__).with_name("_native")
SOURCE = Path(__file__).with_name("gpu.py")
BUILD_HINT = "from a checkout, `make engine` builds the compiled engine (several times faster)"


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """The engine to load and why: ``kind`` is ``compiled`` or ``python``."""

    kind: str
    reason: str


def choose(
    native_dir: Path = NATIVE_DIR,
    source: Path = SOURCE,
    env: Mapping[str, str] = os.environ,
) -> EngineChoice:
    """Decide between the build in ``native_dir`` and the source, without importing either."""
    if env.get(ENV_ENGINE, "").strip().lower() == "python":
        return EngineChoice("python", f"{ENV_ENGINE}=python")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    if not (native_dir / f"gpu{suffix}").is_file():
        return EngineChoice("python", f"not built for this Python: {BUILD_HINT}")
    try:
        built_from = (native_dir / "SOURCE_SHA256").read_text().strip()
    except OSError:
        return EngineChoice("python", f"build has no SOURCE_SHA256: {BUILD_HINT}")
    if built_from != hashlib.sha256(source.read_bytes()).hexdigest():
        return EngineChoice("python", f"built from another gpu.py: {BUILD_HINT}")
    return EngineChoice("compiled", f"mypyc build in {native_dir}")


def select(package_path: MutableSequence[str]) -> EngineChoice:
    """Make the package ``gpushare.sim`` load the chosen engine (call before importing ``gpu``)."""
    choice = choose()
    if choice.kind == "compiled" and str(NATIVE_DIR) not in package_path:
        package_path.insert(0, str(NATIVE_DIR))
    return choice


def loaded() -> str:
    """The engine the imported :mod:`gpushare.sim.gpu` really is: ``compiled`` or ``python``."""
    from gpushare.sim import gpu

    return "python" if gpu.__file__ is None or gpu.__file__.endswith(".py") else "compiled"
