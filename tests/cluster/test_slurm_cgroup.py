"""A foreground ``gpushare submit`` inside a real Slurm job step whose processes Slurm tracks by cgroup.

The cluster of tests/support/slurm_cluster.py with ``proctrack/cgroup`` and ``task/cgroup``: every
step lives in a cgroup of Slurm's own, and Slurm's accounting and its kill of a job go by that
cgroup. A step runs ``gpushare submit --offline -- sleep`` in the foreground against a real test
daemon; the workload becomes a client and must still be in the step's cgroup, listed by
``scontrol listpids`` and accounted by ``sstat``, and ended by ``scancel`` (issue 29, "Foreground submit in a real Slurm job
step").

Slurm 22.05 tracks with ``cgroup/v2`` only on a host with nothing but the unified hierarchy: on a
hybrid host (cgroup v1 controllers mounted too, as here) its ``slurmd`` exits at start-up with
"fatal: Hybrid mode is not supported", since every process's ``/proc/self/cgroup`` lists the
host's v1 hierarchies, whatever its namespaces. There the test runs with ``cgroup/v1`` (the step's
cgroup is in the v1 ``freezer`` hierarchy) and the ``cgroup/v2`` case is skipped with that reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason
from bench.support.daemon_helpers import REPO, DaemonProc, wait_for
from gpushare.client import ApiClient
from gpushare.node.cgroups.discovery import cgroup2_mount
from gpushare.node.procs.facts import process_cgroup
from tests.support import slurm_cluster


def _hybrid() -> bool:
    return any(not line.startswith("0::") for line in Path("/proc/self/cgroup").read_text().split())


def _skip_reason(plugin: str) -> str | None:
    if (reason := slurm_cluster.skip_reason()) is not None:
        return reason
    if (reason := cgroup_skip_reason()) is not None:
        return reason
    if plugin == "cgroup/v2" and _hybrid():
        return (
            "Slurm 22.05's cgroup/v2 refuses a hybrid host (slurmd: 'fatal: Hybrid mode is not "
            "supported'): this one mounts cgroup v1 hierarchies beside the unified one"
        )
    if plugin == "cgroup/v1" and not _hybrid():
        return "no cgroup v1 hierarchy on this host: the cgroup/v2 case runs instead"
    return None


@pytest.fixture(params=["cgroup/v1", "cgroup/v2"])
def cluster(request: pytest.FixtureRequest) -> Iterator[slurm_cluster.SlurmCluster]:
    plugin = request.param
    if (reason := _skip_reason(plugin)) is not None:
        pytest.skip(reason)
    true = Path("/bin/true")
    c = slurm_cluster.start(prolog=true, task_prolog=true, epilog=true, cgroups=plugin)
    try:
        yield c
    finally:
        c.stop()


def _client(api: ApiClient) -> dict[str, object] | None:
    running = [c for c in api.call("list", {})["clients"] if c["state"] == "running"]
    return running[0] if running else None


def _sstat_pids(cluster: slurm_cluster.SlurmCluster, job: str) -> list[str]:
    """The pids ``sstat`` accounts for in the job's step 0."""
    out = cluster.run("sstat", "-j", f"{job}.0", "-i", "-a", "-n", "-P", "-o", "JobID").stdout
    # -i (--pidformat) prints JobID|Nodelist|Pids, then the fields asked for.
    return [pid for line in out.splitlines() for pid in line.split("|")[2].split(",") if pid]


def _step_cgroup(pid: int) -> str:
    """The cgroup Slurm tracks the step by: v1's ``freezer`` line on a hybrid host, else v2's."""
    lines = dict(
        line.split(":", 2)[1:] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    )
    return lines.get("freezer", lines.get("", ""))


def test_a_foreground_submit_in_a_job_step_stays_in_the_steps_cgroup(
    cluster: slurm_cluster.SlurmCluster,
):
    daemon = DaemonProc(gpus=1).start()
    step = None
    try:
        env = {**cluster.env, "PYTHONPATH": str(REPO), "GPUSHARE_SOCKET": str(daemon.socket)}
        step = subprocess.Popen(
            ["srun", "-n1", "-J", "gs-fg", sys.executable, "-m", "gpushare", "submit",
             "--offline", "--name", "in-step", "--", "sleep", "300"],
            env=env, cwd="/tmp", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        with ApiClient.connect(daemon.socket) as api:
            wait_for(lambda: _client(api) is not None, 30.0, "the step's workload to run")
            client = _client(api)
        assert client is not None and isinstance(client["pid"], int)
        pid = client["pid"]
        # The submitter is the client from its adoption on, and then execs the workload.
        wait_for(lambda: Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\0"), 30.0,
                 "the submitter to exec the workload")  # fmt: skip
        job = (
            Path(f"/proc/{pid}/environ").read_bytes().split(b"SLURM_JOB_ID=", 1)[1].split(b"\0")[0]
        ).decode()
        # Still in the step's cgroup, as Slurm made it, after the daemon took it as a client.
        assert f"/job_{job}/step_0" in _step_cgroup(pid), Path(f"/proc/{pid}/cgroup").read_text()
        if _hybrid() and daemon.cgroup_dir is not None:
            # Slurm tracks it in v1; in v2 it was nobody's, and gpushare gave it a cgroup of its own.
            mount = cgroup2_mount()
            assert mount is not None
            ours = "/" + str(daemon.cgroup_dir.relative_to(mount))
            assert (process_cgroup(pid) or "").startswith(ours + "/"), process_cgroup(pid)
        listed = cluster.run("scontrol", "listpids", job).stdout.split()
        assert str(pid) in listed, listed
        # Slurm's accounting gathers the step's usage from the same cgroup: the client is in it.
        wait_for(lambda: str(pid) in _sstat_pids(cluster, job), 30.0, "sstat to list the client")
        # Slurm ends the job by its cgroup: the client goes with it, and the daemon sees that.
        assert cluster.run("scancel", job).returncode == 0
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), 30.0, "Slurm to end the client")
        with ApiClient.connect(daemon.socket) as api:
            wait_for(lambda: _client(api) is None, 30.0, "the daemon to see the client end")
    finally:
        if step is not None and step.poll() is None:
            os.kill(step.pid, signal.SIGKILL)
            step.wait()
        daemon.cleanup()
