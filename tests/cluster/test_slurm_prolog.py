"""Slurm's Prolog, TaskProlog and Epilog: what they record and send, called directly and run by a
real single-node Slurm.

The cluster (tests/support/slurm_cluster.py) runs the scripts of deploy/slurm/ with only the path
of the gpushare command changed; on the daemon's socket sits a recorder speaking the daemon's
protocol (``recorded``, tests/cluster/conftest.py), so the tests check exactly what the Prolog
and Epilog send.
"""

from __future__ import annotations

import io
import pwd
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from gpushare import config, protocol, slurm
from gpushare.paths import repo_root
from tests.support.slurm_harness import GPU, Harness, _env_of

# ------------------------------------------------------------------------- without a cluster


def _cfg(tmp_path: Path) -> config.Config:
    return config.loads(f'[paths]\nruntime_dir = "{tmp_path}/run"\n')


def test_prolog_never_fails_and_records_what_the_task_prolog_reports(tmp_path: Path):
    cfg, log, out = _cfg(tmp_path), io.StringIO(), io.StringIO()
    sent: list[tuple[str, dict[str, Any]]] = []
    env = {"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "1000", "SLURM_JOB_COMMENT": "gpushare=fast"}
    assert slurm.prolog(env, cfg, lambda m, p: sent.append((m, p)) or "daemon down", log) == 0
    assert sent == []
    assert "job 12: 'fast' is not a gpushare class" in log.getvalue()
    assert slurm.task_prolog({"SLURM_JOB_ID": "12"}, cfg, out) == 1
    assert out.getvalue().startswith(
        "print gpushare: job 12 not started: 'fast' is not a gpushare class"
    )
    # An unreachable daemon is logged; the declaration is still there for the tasks.
    env["SLURM_JOB_COMMENT"] = "gpushare=offline"
    assert slurm.prolog(env, cfg, lambda m, p: sent.append((m, p)) or "daemon down", log) == 0
    assert [m for m, _p in sent] == ["adopt"] and "not registered: daemon down" in log.getvalue()
    out = io.StringIO()
    assert slurm.task_prolog({"SLURM_JOB_ID": "12", "CUDA_VISIBLE_DEVICES": GPU}, cfg, out) == 0
    assert f"export CUDA_MPS_PIPE_DIRECTORY={tmp_path}/run/mps/{GPU}\n" in out.getvalue()
    # The Epilog releases a job it has a file for, or whose comment declares gpushare.
    sent.clear()
    assert slurm.epilog({"SLURM_JOB_ID": "12"}, cfg, lambda m, p: sent.append((m, p)), log) == 0
    assert sent == [("release", {"source": "slurm", "job": "12"})]
    assert not slurm.job_file(cfg, "12").exists()
    assert slurm.epilog({"SLURM_JOB_ID": "12"}, cfg, lambda m, p: sent.append((m, p)), log) == 0
    assert len(sent) == 1
    env13 = {"SLURM_JOB_ID": "13", "SLURM_JOB_COMMENT": "x gpushare=offline"}
    assert slurm.epilog(env13, cfg, lambda m, p: sent.append((m, p)), log) == 0
    assert sent[-1] == ("release", {"source": "slurm", "job": "13"})
    for bad in (
        {},
        {"SLURM_JOB_ID": "../x", "SLURM_JOB_UID": "0"},
        {"SLURM_JOB_ID": "3", "SLURM_JOB_UID": "x"},
    ):
        assert slurm.prolog(bad, cfg, lambda m, p: "unused", log) == 0
        assert slurm.epilog(bad, cfg, lambda m, p: "unused", log) == 0


def test_main_with_a_bad_config(tmp_path: Path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[control]\nperiod = -1\n")
    assert slurm.main(["prolog", "--config", str(bad)]) == 0
    assert slurm.main(["task-prolog", "--config", str(bad)]) == 1
    assert "print gpushare: " in capsys.readouterr().out


# ------------------------------------------------------------------------------ a real Slurm


def test_the_job_user_needs_nothing_inside_the_clone(slurm_harness: Harness):
    """Root may keep the clone where no one else can enter (a 0700 mktemp -d): the scripts the
    job's user runs, and the package they import, must lie outside it, readable by everyone."""
    launcher = (slurm_harness.base / "gpushare").read_text()
    (pythonpath,) = re.findall(r"PYTHONPATH=(\S+)", launcher)
    used = [Path(pythonpath), slurm_harness.base / "task-prolog", Path(pythonpath) / "gpushare"]
    for path in used:
        assert not path.resolve().is_relative_to(repo_root()), path
        assert all(p.stat().st_mode & 0o005 == 0o005 for p in [path, *path.parents]), path
    if slurm_harness.user is not None:
        ran = subprocess.run(
            ["runuser", "-u", slurm_harness.user, "--", str(slurm_harness.base / "gpushare"),
             "slurm", "--help"],
            capture_output=True, text=True, timeout=30, cwd="/", check=False,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr


def test_an_offline_batch_job_gets_its_mps_environment_and_is_registered_then_released(
    recorded,
):
    h = recorded
    job = h.sbatch("--comment", "gpushare=offline,sm=30,mem=2G", wrap="env")
    h.cluster.wait_job(job, ("COMPLETED",))
    env = _env_of(h.output(job))
    assert env["GPUSHARE_CLASS"] == "offline"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == f"{h.base}/run/mps/{GPU}"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{GPU}=2G"
    assert env["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in env
    uid = pwd.getpwnam(h.user).pw_uid if h.user else 0
    params, peer_uid = h.use_recorder().wait("adopt", job)
    assert peer_uid == 0  # the Prolog ran as root
    assert params == {
        "source": "slurm", "job": job, "uid": uid, "cls": "offline",
        "match_env": {"SLURM_JOB_ID": job, "GPUSHARE_CLASS": "offline"}, "pids": [],
        "slo_p99_ms": None, "sm_pct": 30.0,
        "mem_bytes": 2 << 30, "gpu": None,
    }  # fmt: skip
    assert protocol.from_params(protocol.AdoptRequest, params).uid == uid
    assert h.use_recorder().wait("release", job) == ({"source": "slurm", "job": job}, 0)
    assert not h.job_file(job).exists()


def test_an_online_step_gets_its_slo_and_the_whole_gpu(recorded):
    h = recorded
    done = h.cluster.run("srun", "--comment", "gpushare=online,slo-p99=40ms", "--chdir", "/tmp",
                         "env", user=h.user)  # fmt: skip
    assert done.returncode == 0, done.stderr
    env = _env_of(done.stdout)
    assert (env["GPUSHARE_CLASS"], env["GPUSHARE_SLO_P99"]) == ("online", "40ms")
    assert (env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_CLIENT_PRIORITY"]) == (
        "100",
        "0",
    )
    job = env["SLURM_JOB_ID"]
    params, _uid = h.use_recorder().wait("adopt", job)
    assert (params["cls"], params["slo_p99_ms"]) == ("online", 40.0)


def test_a_job_with_an_unknown_class_fails_with_the_reason_and_disturbs_nothing(recorded):
    h = recorded
    job = h.sbatch("--comment", "gpushare=batch", wrap="echo THE TASK RAN")
    info = h.cluster.wait_job(job, ("FAILED", "COMPLETED"))
    out = h.output(job)
    assert info["JobState"] == "FAILED"
    assert (
        f"gpushare: job {job} not started: 'batch' is not a gpushare class: use --comment gpushare=offline"
        in out
    )
    assert "THE TASK RAN" not in out
    assert h.cluster.node_state() == "idle"  # the node is not drained
    time.sleep(0.5)
    assert "adopt" not in h.use_recorder().for_job(job)


def test_a_job_without_a_declaration_is_left_alone(recorded):
    h = recorded
    done = h.cluster.run("srun", "--chdir", "/tmp", "env", user=h.user)
    assert done.returncode == 0, done.stderr
    env = _env_of(done.stdout)
    assert not any(k.startswith(("CUDA_MPS_", "GPUSHARE_")) for k in env)
    assert h.use_recorder().for_job(env["SLURM_JOB_ID"]) == []


def test_a_job_cancelled_by_slurm_is_released(recorded):
    h = recorded
    job = h.sbatch("--comment", "gpushare=offline", wrap="sleep 300")
    h.cluster.wait_job(job, ("RUNNING",))
    h.use_recorder().wait("adopt", job)
    assert h.job_file(job).exists()
    assert h.cluster.run("scancel", job).returncode == 0
    h.cluster.wait_job(job, ("CANCELLED",))
    h.use_recorder().wait("release", job)
    deadline = time.monotonic() + 10
    while h.job_file(job).exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_task_that_sees_two_gpus_is_refused(recorded):
    h = recorded
    # srun passes its environment on to the task (--export=ALL), as a job's GRES would set it.
    done = h.cluster.run("srun", "--comment", "gpushare=offline", "--chdir", "/tmp", "echo",
                         "THE TASK RAN", user=h.user, CUDA_VISIBLE_DEVICES="0,1")  # fmt: skip
    assert done.returncode != 0
    assert "the task sees GPUs 0,1; a gpushare client runs on one GPU" in done.stdout
    assert "THE TASK RAN" not in done.stdout
