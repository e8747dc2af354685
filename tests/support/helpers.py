"""Shared test helpers: where the real MPS binary is, and reasons for skipping."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gpushare.paths import repo_root

MPS_CACHE = repo_root() / ".cache" / "mps" / "root"


def find_mps_control() -> Path | None:
    """The real nvidia-cuda-mps-control: the system's first, then the one `make test` fetched."""
    found = shutil.which("nvidia-cuda-mps-control")
    if found:
        return Path(found)
    cached = MPS_CACHE / "usr" / "bin" / "nvidia-cuda-mps-control"
    return cached if os.access(cached, os.X_OK) else None


def mps_server_dir() -> Path | None:
    """The directory holding nvidia-cuda-mps-server, which the control daemon finds through PATH."""
    found = shutil.which("nvidia-cuda-mps-server")
    if found:
        return Path(found).parent
    cached = MPS_CACHE / "usr" / "sbin"
    return cached if (cached / "nvidia-cuda-mps-server").exists() else None


MPS_MISSING = (
    "the real nvidia-cuda-mps-control is not available: run scripts/get-mps-control.sh "
    "(needs apt-get and the Debian archive) or install nvidia-cuda-mps"
)
