"""The compiled GPU model: chosen only when complete and current, and identical to the source."""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.sim import engine

REPO = Path(__file__).resolve().parents[2]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _build(tmp_path: Path, recorded: bool = True) -> tuple[Path, Path]:
    """A source directory with every compiled module and a complete build of it (empty files)."""
    src = tmp_path / "sim"
    src.mkdir()
    for m in engine.COMPILED:
        (src / f"{m}.py").write_text(f"x = {m!r}\n")
    native = tmp_path / "_native"
    native.mkdir()
    for name in (engine.SHARED_LIB, *engine.COMPILED):
        (native / f"{name}{SUFFIX}").write_bytes(b"")
    if recorded:
        (native / engine.RECORD).write_text(engine.record(src))
    return native, src


def test_the_build_compiles_the_gpu_model_as_one_group() -> None:
    assert set(engine.COMPILED) >= {"gpu", "events", "dispatch", "waves", "timeslice"}
    assert engine.SHARED_LIB == "gpu__mypyc"


def test_a_build_of_the_current_sources_is_chosen(tmp_path: Path) -> None:
    native, src = _build(tmp_path)
    assert engine.choose(native, src, env={}).kind == "compiled"


@pytest.mark.parametrize("module", engine.COMPILED)
def test_an_edit_to_any_compiled_source_makes_the_build_unused(tmp_path: Path, module: str) -> None:
    native, src = _build(tmp_path)
    with (src / f"{module}.py").open("a") as f:
        f.write("# edited\n")
    choice = engine.choose(native, src, env={})
    assert choice.kind == "python"
    assert f"built from another {module}.py:" in choice.reason
    # A wheel user has no Makefile: the line says there is nothing to fix (issue 28.6).
    assert "same results, only slower; nothing to fix" in choice.reason


def test_a_record_of_the_single_module_build_is_not_current(tmp_path: Path) -> None:
    native, src = _build(tmp_path)
    # What the build of gpu.py alone recorded: one digest, no file names.
    (native / engine.RECORD).write_text(hashlib.sha256((src / "gpu.py").read_bytes()).hexdigest())
    choice = engine.choose(native, src, env={})
    assert choice.kind == "python"
    assert all(f"{m}.py" in choice.reason for m in engine.COMPILED)


def test_no_build_or_no_record_means_python(tmp_path: Path) -> None:
    native, src = _build(tmp_path, recorded=False)
    choice = engine.choose(native, src, env={})
    assert (choice.kind, engine.RECORD in choice.reason) == ("python", True)
    for f in native.iterdir():
        f.unlink()
    choice = engine.choose(native, src, env={})
    assert (choice.kind, "not built" in choice.reason) == ("python", True)


@pytest.mark.parametrize("name", ["dispatch", "gpu__mypyc"])
def test_an_incomplete_build_means_python(tmp_path: Path, name: str) -> None:
    native, src = _build(tmp_path)
    (native / f"{name}{SUFFIX}").unlink()
    choice = engine.choose(native, src, env={})
    assert choice.kind == "python"
    assert f"incomplete build (no {name}{SUFFIX})" in choice.reason


def test_the_environment_forces_python(tmp_path: Path) -> None:
    native, src = _build(tmp_path)
    choice = engine.choose(native, src, env={engine.ENV_ENGINE: "python"})
    assert choice.kind == "python"


def test_the_record_is_what_sha256sum_prints(tmp_path: Path) -> None:
    _, src = _build(tmp_path)
    proc = subprocess.run(
        ["sha256sum", *(f"{m}.py" for m in engine.COMPILED)],
        cwd=src,
        capture_output=True,
        text=True,
        check=True,
    )
    assert engine.record(src) == proc.stdout


def _loaded(root: Path, env_engine: str | None = None) -> list[str]:
    """``engine.loaded()``, the choice's reason and each module's file, imported from ``root``."""
    env = {k: v for k, v in os.environ.items() if k != engine.ENV_ENGINE}
    env["PYTHONPATH"] = str(root)
    if env_engine is not None:
        env[engine.ENV_ENGINE] = env_engine
    code = (
        "import importlib; from gpushare.sim import ENGINE, engine; print(engine.loaded());"
        " print(ENGINE.reason); [print(importlib.import_module('gpushare.sim.' + m).__file__)"
        " for m in engine.COMPILED]"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def _real_build() -> None:
    if engine.choose().kind != "compiled":
        pytest.skip(f"compiled engine not available: {engine.choose().reason}")


def test_the_real_build_loads_every_module_compiled_and_says_so(tmp_path: Path) -> None:
    _real_build()
    out = _loaded(REPO)
    assert out[0] == "compiled"
    assert all(f.startswith(str(engine.NATIVE_DIR)) for f in out[2:]), out
    forced = _loaded(REPO, "python")
    assert forced[0] == "python"
    assert all(f.endswith(".py") for f in forced[2:]), forced


@pytest.mark.parametrize("module", engine.COMPILED)
def test_an_edit_to_a_real_source_falls_back_to_python(tmp_path: Path, module: str) -> None:
    """A copy of the package with its real build: compiled, until one source changes."""
    _real_build()
    root = tmp_path / "root"
    (root / "gpushare").mkdir(parents=True)
    (root / "gpushare" / "__init__.py").write_text("")
    sim = root / "gpushare" / "sim"
    sim.mkdir()
    for f in ("__init__.py", "engine.py", *(f"{m}.py" for m in engine.COMPILED)):
        shutil.copy(REPO / "gpushare" / "sim" / f, sim / f)
    shutil.copytree(engine.NATIVE_DIR, sim / "_native")
    assert _loaded(root)[0] == "compiled"
    with (sim / f"{module}.py").open("a") as f:
        f.write("# edited\n")
    out = _loaded(root)
    assert out[0] == "python"
    assert f"built from another {module}.py:" in out[1]
    assert all(f.endswith(".py") for f in out[2:]), out


def _sim(tmp_path: Path, name: str, env_engine: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != engine.ENV_ENGINE}
    if env_engine is not None:
        env[engine.ENV_ENGINE] = env_engine
    out = tmp_path / name
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpushare",
            "sim",
            str(REPO / "gpushare" / "scenarios" / "alibaba-node-mix.toml"),
            "--policy",
            "gpushare",
            "--policy",
            "mps-priority",
            "--duration",
            "2",
            "--no-progress",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, object] = json.loads((out / "alibaba-node-mix.json").read_text())
    return doc


def _without_timing(v: object) -> object:
    if isinstance(v, dict):
        return {
            k: _without_timing(x)
            for k, x in v.items()
            if k not in ("wall_s", "speed_factor", "engine")
        }
    if isinstance(v, list):
        return [_without_timing(x) for x in v]
    return v


def test_the_compiled_engine_gives_bit_identical_results(tmp_path: Path) -> None:
    if engine.choose().kind != "compiled":
        pytest.skip(f"compiled engine not available: {engine.choose().reason}")
    compiled = _sim(tmp_path, "compiled", None)
    python = _sim(tmp_path, "python", "python")
    assert (compiled["engine"], python["engine"]) == ("compiled", "python")
    # Contended runs of both GPUs, every kernel count and float to the last bit.
    assert _without_timing(compiled) == _without_timing(python)
