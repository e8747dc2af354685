"""scripts/get-mps-control.sh: idempotent, skips when a system binary exists, fails clearly."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.support.helpers import MPS_CACHE
from gpushare.paths import repo_root

SCRIPT = repo_root() / "scripts" / "get-mps-control.sh"
BASH = shutil.which("bash") or "/bin/bash"


def _run(cache: Path, *, env_extra=None, path=None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env_extra or {})}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [BASH, str(SCRIPT), str(cache)], capture_output=True, text=True, timeout=300, env=env
    )


def _binaries(cache: Path) -> list[Path]:
    return [
        cache / "root/usr/bin/nvidia-cuda-mps-control",
        cache / "root/usr/sbin/nvidia-cuda-mps-server",
    ]


def test_second_run_changes_nothing(tmp_path: Path):
    if not (MPS_CACHE / "usr/bin/nvidia-cuda-mps-control").exists():
        pytest.skip("no fetched MPS package to seed from (run scripts/get-mps-control.sh)")
    cache = tmp_path / "mps"
    shutil.copytree(MPS_CACHE, cache / "root", symlinks=True)
    before = [p.stat().st_mtime_ns for p in _binaries(cache)]
    result = _run(cache, env_extra={"GPUSHARE_FORCE_MPS_FETCH": "1"})
    assert result.returncode == 0, result.stderr
    assert "already present" in result.stderr
    assert [p.stat().st_mtime_ns for p in _binaries(cache)] == before


def test_fetch_then_rerun(tmp_path: Path):
    cache = tmp_path / "mps"
    first = _run(cache, env_extra={"GPUSHARE_FORCE_MPS_FETCH": "1"})
    if first.returncode != 0 and "apt-get update failed" in first.stderr:
        pytest.skip(f"the Debian archive is unreachable from here: {first.stderr.strip()}")
    assert first.returncode == 0, first.stderr
    assert all(os.access(p, os.X_OK) for p in _binaries(cache))
    assert "installed nvidia-cuda-mps_" in first.stderr
    second = _run(cache, env_extra={"GPUSHARE_FORCE_MPS_FETCH": "1"})
    assert second.returncode == 0
    assert "already present" in second.stderr
    assert not (cache / "root.tmp").exists()


def test_system_binary_on_path_skips_the_fetch(tmp_path: Path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "nvidia-cuda-mps-control"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    cache = tmp_path / "mps"
    result = _run(cache, path=f"{bindir}:{os.environ['PATH']}")
    assert result.returncode == 0
    assert f"system binary found at {fake}" in result.stderr
    assert not cache.exists()


def test_without_apt_get_fails_with_the_fix(tmp_path: Path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # Only what the script needs before it looks for apt-get.
    for tool in ("dirname",):
        (bindir / tool).symlink_to(shutil.which(tool) or f"/usr/bin/{tool}")
    result = _run(tmp_path / "mps", path=str(bindir))
    assert result.returncode != 0
    assert "apt-get not found" in result.stderr
    assert "nvidia-cuda-mps" in result.stderr
    assert not (tmp_path / "mps").exists()
