"""Issue 32: a real PyTorch training job, restarted by gpushare, resumes from its checkpoint.

``examples/train_checkpoint.py`` runs for real on the CPU under Debian's ``python3-torch`` (a
CPU build; ``scripts/get-torch.sh``, run by ``make test``'s setup, installs it) as a restartable
offline client of a real daemon (the duty-responsive fake GPU of tests/daemon/test_e2e_control.py).
Online demand measured while offline work is frozen lowers the share, the daemon checkpoints the
job with its signal and relaunches it, and the relaunched process carries on from the iteration
after the last one it logged: it loses at most one iteration (this script, none).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason
from bench.support.daemon_helpers import wait_for
from tests.daemon.test_e2e_control import E2e, _start

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_checkpoint.py"
# Debian's torch is for the system interpreter, not the test's virtual environment.
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin")


def _torch_missing() -> str | None:
    if SYSTEM_PYTHON is None:
        return "no /usr/bin/python3"
    done = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import torch"], capture_output=True, timeout=120, check=False
    )
    if done.returncode != 0:
        return (
            "Debian's python3-torch is not installed for /usr/bin/python3 "
            "(scripts/get-torch.sh installs it; make test runs it as root)"
        )
    return None


def _runs(log: Path) -> list[tuple[int, list[int]]]:
    """The log's iterations per process, in order: ``[(pid, [iteration, ...]), ...]``."""
    runs: list[tuple[int, list[int]]] = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) != 3:
            continue  # a line being written
        pid, it = int(parts[0]), int(parts[1])
        if not runs or runs[-1][0] != pid:
            runs.append((pid, []))
        runs[-1][1].append(it)
    return runs


def _logged(log: Path, run: int) -> int:
    """How many iterations the ``run``-th process logged (0: none yet)."""
    runs = _runs(log) if log.exists() else []
    return len(runs[run][1]) if len(runs) > run else 0


def test_a_pytorch_job_restarted_by_gpushare_resumes_losing_at_most_one_iteration(
    tmp_path: Path,
) -> None:
    if (why := _torch_missing()) is not None:
        pytest.skip(why)
    assert SYSTEM_PYTHON is not None
    tmp_path.chmod(0o755)
    ckpt, log = tmp_path / "ckpt.pt", tmp_path / "train.log"
    pauser = "cgroup" if cgroup_skip_reason() is None else "signal"
    # A restart that costs 1 s: the cut pays once it held that long with the duty at 0.
    e2e: E2e = _start(pauser, 'share_min_interval = "1s"\nrestart_cost = "1s"\n')
    try:
        (e2e.state_dir / "sm_active").write_text("0")
        out = e2e.cli(
            "submit", "--offline", "--detach", "--gpu", "0", "--restartable", "--",
            SYSTEM_PYTHON, str(EXAMPLE), "--checkpoint", str(ckpt), "--log", str(log),
            "--iterations", "1000000", "--every", "1000000", "--sleep", "0.02",
        )  # fmt: skip
        job = out.split()[0]
        first = e2e.dp.client(job)
        # Training for real: some iterations logged (torch's import takes a few seconds).
        wait_for(lambda: _logged(log, 0) >= 5, 60.0, "iterations")
        e2e.submit_online("40ms")
        (e2e.state_dir / "sm_active").write_text("70")
        e2e.burst(True)

        def relaunched() -> dict[str, Any] | None:
            c = e2e.dp.client(job)
            return c if c["restarts"] >= 1 and c["state"] in ("running", "throttled") else None

        now = wait_for(relaunched, 90.0, "the restart under the new share")
        e2e.burst(False)
        assert now["pid"] != first["pid"]
        wait_for(lambda: _logged(log, 1) >= 3, 60.0, "resumed")
        (pid1, before), (pid2, after) = _runs(log)[:2]
        assert pid1 != pid2
        assert before == list(range(1, len(before) + 1)), "consecutive before the restart"
        # The relaunched process goes on from its checkpoint: at most one iteration done again.
        assert after[0] in (before[-1], before[-1] + 1), (before[-3:], after[:3])
        assert after == list(range(after[0], after[0] + len(after)))
        assert ckpt.exists()
    finally:
        e2e.close()
