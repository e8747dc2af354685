"""Slurm jobs adopted by a real daemon: on a real single-node Slurm, a real ``gpushare daemon
--simulate 1`` on the socket the Prolog and Epilog talk to (``with_daemon``,
tests/cluster/conftest.py) adopts the jobs' processes, controls them and releases them.
"""

from __future__ import annotations

import pwd
import subprocess
import sys
import time
from pathlib import Path

from bench.support.daemon_helpers import wait_for
from gpushare.node.cgroups.discovery import cgroup2_mount
from gpushare.node.procs.facts import process_cgroup
from tests.support.slurm_harness import Harness, _job_clients


def _srun_job(h: Harness, other: str) -> str | None:
    """The id of the running job that is not ``other`` (the srun step started last)."""
    out = h.cluster.run("squeue", "-h", "-t", "RUNNING", "-o", "%i").stdout.split()
    return next((j for j in out if j != other), None)


def _proc_state(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    return raw[raw.rfind(")") + 2]


def test_slurm_jobs_are_adopted_controlled_and_released_by_a_real_daemon(with_daemon):
    h = with_daemon
    # The simulated node gives each adopted process a simulated twin from its environment: a
    # training job that loads the GPU, and a service whose 1 ms p99 SLO it cannot meet beside it.
    off = h.sbatch("--comment", "gpushare=offline",
                   "--export", "ALL,GPUSHARE_SIM_PROFILE=resnet50-train", wrap="sleep 300")  # fmt: skip
    # The online service runs in the foreground under srun, as an interactive step would.
    serve = subprocess.Popen(
        [*(["runuser", "-u", h.user, "--"] if h.user else []), "srun", "--comment",
         "gpushare=online,slo-p99=1ms", "--chdir", "/tmp", "sleep", "300"],
        env={**h.cluster.env, "GPUSHARE_SIM_PROFILE": "resnet50-inference", "GPUSHARE_SIM_RPS": "40"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/tmp",
    )  # fmt: skip
    try:
        on = wait_for(lambda: _srun_job(h, off), 30, "the srun job")
        found = wait_for(
            lambda: len(c := _job_clients(h, off, on)) == 2 and c, 30, "both jobs adopted"
        )
        assert (found[off]["class"], found[on]["class"]) == ("offline", "online")
        assert found[on]["slo_p99_ms"] == 1.0
        uid = pwd.getpwnam(h.user).pw_uid if h.user else 0
        assert found[off]["uid"] == found[on]["uid"] == uid
        assert found[off]["pause_mechanism"] in ("cgroup", "signal")
        assert found[off]["pause_reason"]
        text = subprocess.run(
            [sys.executable, "-c", "from gpushare.cli.app import main; main()", "status",
             "--socket", str(h.socket)], capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
        assert f"{found[off]['id']}: adopted by slurm job {off}; paused by " in text
        # The controller freezes the offline job for the online one's SLO...
        pid = found[off]["pid"]
        wait_for(lambda: _proc_state(pid) == "T" or "frozen 1" in _cgroup_events(pid), 30,
                 "the offline job frozen by the controller")  # fmt: skip
        # ... and thaws it for good once the online job is gone.
        assert h.cluster.run("scancel", on).returncode == 0
        h.cluster.wait_job(on, ("CANCELLED",))
        serve.wait(timeout=30)
        wait_for(lambda: on not in _job_clients(h, on), 30, "the online job's client to end")

        def thawed_for_a_while() -> bool:
            for _ in range(10):
                if _proc_state(pid) == "T" or "frozen 1" in _cgroup_events(pid):
                    return False
                time.sleep(0.1)
            return True

        wait_for(thawed_for_a_while, 30, "the offline job thawed")
        assert _job_clients(h, off)[off]["state"] == "running"
        # scancel ends it cleanly; the Epilog's release leaves nothing behind.
        assert h.cluster.run("scancel", off).returncode == 0
        h.cluster.wait_job(off, ("CANCELLED",))
        wait_for(lambda: not _job_clients(h, off), 30, "the offline client to end")
        wait_for(lambda: not h.job_file(off).exists(), 30, "the Epilog")
        ended = {c["id"]: c for c in h.call("list", {"all": True})["clients"]}
        # Ended by Slurm's signal (as the exit status the daemon could read says), or released.
        assert ended[found[off]["id"]]["state"] in ("exited", "failed"), ended[found[off]["id"]]
        assert len([c for c in ended.values() if c.get("adopted_by") == f"slurm job {off}"]) == 1
        assert _proc_state(pid) == "gone"
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_a_job_killed_by_slurm_leaves_no_record_behind(with_daemon):
    h = with_daemon
    job = h.sbatch("--comment", "gpushare=offline", wrap="sleep 300")
    client = wait_for(lambda: _job_clients(h, job).get(job), 30, "the job adopted")
    assert h.cluster.run("scancel", "--signal=KILL", "--full", job).returncode == 0
    h.cluster.wait_job(job, ("CANCELLED", "FAILED"))
    wait_for(lambda: not _job_clients(h, job), 30, "the client to end")
    wait_for(lambda: not h.job_file(job).exists(), 30, "the Epilog")
    wait_for(lambda: any(e["kind"] == "job_released" and f"slurm job {job}" in e["message"]
                         for e in h.call("events", {"limit": 10000})["events"]), 30, "the release")  # fmt: skip
    live = [c for c in h.call("list", {})["clients"] if c["id"] == client["id"]]
    assert live == []


def test_a_job_with_an_unknown_class_never_reaches_the_daemon(with_daemon):
    h = with_daemon
    job = h.sbatch("--comment", "gpushare=batch", wrap="sleep 300")
    assert h.cluster.wait_job(job, ("FAILED", "COMPLETED"))["JobState"] == "FAILED"
    assert not _job_clients(h, job)
    assert h.cluster.node_state() == "idle"


def _cgroup_events(pid: int) -> str:
    try:
        rel = process_cgroup(pid)
        mount = cgroup2_mount()
        if rel is None or mount is None or rel == "/":
            return ""
        return (mount / rel.lstrip("/") / "cgroup.events").read_text()
    except OSError:
        return ""
