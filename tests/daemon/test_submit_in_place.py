"""Foreground submit inside a Slurm job's cgroup: the caller stays in its cgroup (adopted in place).

A real cgroup v2 tree shaped as slurmstepd makes it (``.../slurmstepd.scope/job_42/step_0/
task_0``), a real daemon, the real CLI started inside that cgroup. On b0c0ecb the submitter was
moved into gpushare's own cgroup, out of the job's limits and accounting.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from bench.support.daemon_helpers import REPO, DaemonProc
from gpushare.daemon.submitq import managed_cgroup

SKIP = cgroup_skip_reason()


def test_which_cgroups_are_someone_elses() -> None:
    assert managed_cgroup("/system.slice/slurmstepd.scope/job_42/step_0/user/task_0")
    assert managed_cgroup("/slurm/uid_1000/job_7/step_batch")
    assert managed_cgroup(
        "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod7a5c3b2e_1f4d_4c8a_9b6e_"
        "2d3f4a5b6c7d.slice/cri-containerd-" + "3f1b5a0c9d8e" * 5 + "abcd.scope"
    )
    assert managed_cgroup("/user.slice/user-1000.slice/session-3.scope") is None
    assert managed_cgroup("/") is None
    assert managed_cgroup("/system.slice/job_42.service") is None  # no Slurm above it


@pytest.fixture
def job_cgroup() -> Iterator[Path]:
    if SKIP:
        pytest.skip(SKIP)
    base = unique_base("gs-slurm-test")
    task = base / "slurmstepd.scope" / "job_42" / "step_0" / "task_0"
    task.mkdir(parents=True)
    try:
        yield task
    finally:
        remove_tree(base)


def test_a_foreground_submit_in_a_slurm_job_stays_in_the_jobs_cgroup(job_cgroup: Path) -> None:
    d = DaemonProc(gpus=1)
    try:
        d.start()
        procs = str(job_cgroup / "cgroup.procs")
        script = "print(open('/proc/self/cgroup').read().strip(), flush=True)"
        r = subprocess.run(
            [sys.executable, "-m", "gpushare", "submit", "--offline", "--", sys.executable, "-c",
             script],
            cwd=REPO, env={**os.environ, "GPUSHARE_SOCKET": str(d.socket)}, capture_output=True,
            text=True, timeout=30, check=False,
            preexec_fn=lambda: Path(procs).write_text(str(os.getpid())),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        cgroup = r.stdout.strip().partition("::")[2]
        # Still the job's task cgroup: not moved into gpushare's.
        assert cgroup.endswith("/slurmstepd.scope/job_42/step_0/task_0"), cgroup
        messages = [e["message"] for e in d.events() if e["kind"] == "client_running"]
        assert any("runs in place, in the Slurm job's cgroup" in m for m in messages), messages
    finally:
        d.cleanup()
