"""Shared test helpers: where the real MPS binary is, and reasons for skipping."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from bench.support.trusted import trusted_base
from gpushare.paths import repo_root
from gpushare.trust import TrustCheck

MPS_CACHE = repo_root() / ".cache" / "mps" / "root"


TRUSTED_MPS_COPY = "gpushare-test-mps"
"""Where, below a root-only directory, the fetched binaries are copied when the clone's own copy
is not trusted (tests/conftest.py removes it at the end of the session)."""


def _mps_root() -> Path:
    """The fetched binaries' root where the daemon trusts them (gpushare.trust refuses others).

    The clone's ``.cache`` when it is root's all the way up; else (a clone under /tmp or a home
    directory) a copy below a root-only directory, made once and shared by the test daemons.
    """
    control = MPS_CACHE / "usr" / "bin" / "nvidia-cuda-mps-control"
    base = trusted_base()
    if (
        base is None
        or not control.exists()
        or TrustCheck().refusal(control, what="the cached MPS binary") is None
    ):
        return MPS_CACHE
    copy = base / TRUSTED_MPS_COPY
    if not (copy / "usr" / "bin" / "nvidia-cuda-mps-control").exists():
        tmp = Path(tempfile.mkdtemp(prefix=f".{TRUSTED_MPS_COPY}-", dir=base))
        shutil.copytree(MPS_CACHE / "usr", tmp / "usr", symlinks=True)
        for top, dirs, files in os.walk(tmp):
            for name in (*dirs, *files):
                path = Path(top) / name
                if not path.is_symlink():
                    path.chmod(path.stat().st_mode & ~0o022)
        tmp.chmod(0o755)
        try:
            tmp.rename(copy)
        except OSError:  # another test process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return copy


def find_mps_control() -> Path | None:
    """The real nvidia-cuda-mps-control: the system's first, then the one `make test` fetched."""
    found = shutil.which("nvidia-cuda-mps-control")
    if found:
        return Path(found)
    cached = _mps_root() / "usr" / "bin" / "nvidia-cuda-mps-control"
    return cached if os.access(cached, os.X_OK) else None


def mps_server_dir() -> Path | None:
    """The directory holding nvidia-cuda-mps-server, which the control daemon finds through PATH."""
    found = shutil.which("nvidia-cuda-mps-server")
    if found:
        return Path(found).parent
    cached = _mps_root() / "usr" / "sbin"
    return cached if (cached / "nvidia-cuda-mps-server").exists() else None


MPS_MISSING = (
    "the real nvidia-cuda-mps-control is not available: run scripts/get-mps-control.sh "
    "(needs apt-get and the Debian archive) or install nvidia-cuda-mps"
)
