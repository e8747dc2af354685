"""Naming a checkout in committed bench results: its commit, never its path on this machine."""

from __future__ import annotations

import subprocess
from pathlib import Path


def tree_commit(tree: Path) -> str:
    """The tree's commit (``git describe --always --dirty``), or ``unknown`` outside git."""
    r = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"],
                       capture_output=True, text=True, check=False)  # fmt: skip
    return r.stdout.strip() or "unknown"
