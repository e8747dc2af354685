"""The compiled GPU model: chosen only when current, and identical to the pure-Python source."""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.sim import engine

REPO = Path(__file__).resolve().parents[2]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _build(tmp_path: Path, source: bytes, recorded: bytes | None) -> tuple[Path, Path]:
    src = tmp_path / "gpu.py"
    src.write_bytes(source)
    native = tmp_path / "_native"
    native.mkdir()
    (native / f"gpu{SUFFIX}").write_bytes(b"")
    if recorded is not None:
        (native / "SOURCE_SHA256").write_text(hashlib.sha256(recorded).hexdigest() + "\n")
    return native, src


def test_a_build_of_the_current_source_is_chosen(tmp_path: Path) -> None:
    native, src = _build(tmp_path, b"x = 1\n", b"x = 1\n")
    assert engine.choose(native, src, env={}).kind == "compiled"


def test_a_build_of_an_edited_source_is_never_chosen(tmp_path: Path) -> None:
    native, src = _build(tmp_path, b"x = 2\n", b"x = 1\n")
    choice = engine.choose(native, src, env={})
    assert choice.kind == "python"
    assert "another gpu.py" in choice.reason
    assert "make engine" in choice.reason


def test_no_build_or_no_record_means_python(tmp_path: Path) -> None:
    native, src = _build(tmp_path, b"x = 1\n", None)
    assert engine.choose(native, src, env={}).kind == "python"
    (native / f"gpu{SUFFIX}").unlink()
    choice = engine.choose(native, src, env={})
    assert (choice.kind, "not built" in choice.reason) == ("python", True)


def test_the_environment_forces_python(tmp_path: Path) -> None:
    native, src = _build(tmp_path, b"x = 1\n", b"x = 1\n")
    choice = engine.choose(native, src, env={engine.ENV_ENGINE: "python"})
    assert choice.kind == "python"


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
