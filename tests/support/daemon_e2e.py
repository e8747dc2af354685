"""What the end-to-end daemon tests share: the CLI run against a daemon's socket, a client's
state, and the unprivileged uid and the skip for tests that switch to it.

The module-scoped real daemon they run against is tests/daemon/conftest.py's ``daemon``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.support.daemon_helpers import REPO, DaemonProc, python_for_others

#: The uid (and gid) of ``nobody``, the other user of the rights tests.
NOBODY = 65534

#: Skips a test that switches to another uid where it cannot.
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or python_for_others() is None,
    reason="needs root (to switch uid) and a Python interpreter other uids may execute",
)


def _state(d: DaemonProc, cid: str) -> str:
    """The state of client ``cid`` as the daemon reports it."""
    return str(d.client(cid)["state"])


def run_cli(d: DaemonProc, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``python -m gpushare ARGS`` against ``d``'s socket; its output captured, never raising."""
    return subprocess.run(
        [sys.executable, "-m", "gpushare", *args],
        cwd=REPO,
        env={**os.environ, "GPUSHARE_SOCKET": str(d.socket)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
