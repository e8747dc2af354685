"""Slurm: the job declaration, and the Prolog/TaskProlog/Epilog run by a real single-node Slurm.

The cluster (tests/support/slurm_cluster.py) runs the scripts of deploy/slurm/ with only the path of the
gpushare command changed. On the daemon's socket sits either a recorder speaking the daemon's
protocol, so the tests check exactly what the Prolog and Epilog send, or a real
``gpushare daemon --simulate 1``, which adopts the jobs' processes, controls them and releases them.
"""

from __future__ import annotations

import io
import json
import pwd
import re
import shutil
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from bench.support.daemon_helpers import install_package_for_others, python_for_others, wait_for
from bench.support.trusted import make_trusted_dir
from gpushare import config, protocol, slurm
from gpushare.client import ApiClient
from gpushare.model import ClientClass
from gpushare.node.cgroups.discovery import cgroup2_mount
from gpushare.node.procs.facts import process_cgroup
from gpushare.paths import repo_root
from tests.cluster import slurm_accounting
from tests.support import slurm_cluster

GPU = "GPU-8a2f1c3e-1111-2222-3333-444455556666"


# ------------------------------------------------------------------------- without a cluster


@pytest.mark.parametrize(
    ("comment", "want"),
    [
        (None, None),
        ("nightly run for team a", None),
        ("gpushare=offline", slurm.JobClass(ClientClass.OFFLINE)),
        ("team-a gpushare=online,slo-p99=40ms,sm=60,mem=20G x", slurm.JobClass(ClientClass.ONLINE, 0.04, 60.0, 20 << 30)),
    ],
)  # fmt: skip
def test_the_declaration_in_a_job_comment(comment, want):
    assert slurm.parse_comment(comment) == want


@pytest.mark.parametrize(
    ("comment", "message"),
    [
        ("gpushare=batch", "'batch' is not a gpushare class: use --comment gpushare=offline"),
        ("gpushare=", "'' is not a gpushare class"),
        ("gpushare=offline,slo-p99=40ms", "--slo-p99 applies to --online workloads only"),
        ("gpushare=online,sm=150", "--sm must be a percentage in (0, 100], got 150"),
        ("gpushare=online,sm=lots", "could not convert string to float"),
        ("gpushare=offline,mem=8Q", "expected a size such as 512M"),
        ("gpushare=offline,gpu=1", "'gpu=1' in the comment is not one of slo-p99=, sm=, mem="),
        ("gpushare=offline gpushare=online", "declares gpushare twice"),
    ],
)
def test_a_bad_declaration_names_the_fix(comment, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        slurm.parse_comment(comment)


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, None),
        ({"SLURM_JOB_GPUS": "3"}, "3"),
        ({"SLURM_STEP_GPUS": "2", "SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0"}, "2"),
        ({"SLURM_STEP_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "3"}, "3"),
        ({"CUDA_VISIBLE_DEVICES": GPU}, GPU),
        ({"CUDA_VISIBLE_DEVICES": "1"}, "1"),
    ],
)
def test_the_gpu_of_a_task(env, want):
    assert slurm.task_gpu(env) == want


@pytest.mark.parametrize(
    "env",
    [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"SLURM_STEP_GPUS": "0,1"}, {"SLURM_STEP_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0"}],
)  # fmt: skip
def test_a_task_on_several_gpus_is_refused(env):
    with pytest.raises(ValueError, match="one GPU|not one of the step's GPUs"):
        slurm.task_gpu(env)


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


class _Recorder(socketserver.ThreadingUnixStreamServer):
    """Speaks the daemon's protocol: answers hello and status, records adopt and release."""

    daemon_threads = True

    def __init__(self, path: Path) -> None:
        self.requests: list[tuple[str, dict[str, Any], int]] = []
        self.lock = threading.Lock()
        #: What the Prolog, TaskProlog and Epilog printed (not in the logs the test reads), for the
        #: message of a request that never came.
        self.scripts_log: Path | None = None
        #: slurmd's log: how long each Prolog ran, and whether slurmd saw it fail.
        self.slurmd_log: Path | None = None
        super().__init__(str(path), _Handler)
        path.chmod(0o666)

    def wait(self, method: str, job: str, timeout_s: float = 30) -> tuple[dict[str, Any], int]:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                found = [
                    (p, uid) for m, p, uid in self.requests if m == method and p.get("job") == job
                ]
            if found:
                return found[0]
            if time.monotonic() >= deadline:
                printed = self.scripts_log.read_text() if self.scripts_log is not None else ""
                slurmd = self.slurmd_log.read_text() if self.slurmd_log is not None else ""
                about_job = [line for line in slurmd.splitlines() if job in line]
                raise AssertionError(
                    f"no {method} for job {job}: {self.requests}; the scripts printed: {printed!r}; "
                    f"slurmd logged of it: {about_job}"
                )
            time.sleep(0.05)

    def for_job(self, job: str) -> list[str]:
        with self.lock:
            return [m for m, p, _uid in self.requests if p.get("job") == job]


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        creds = self.request.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
        )
        _pid, uid, _gid = struct.unpack("3i", creds)
        server: _Recorder = self.server  # type: ignore[assignment]
        for line in self.rfile:
            msg = json.loads(line)
            method, params = msg["method"], msg.get("params", {})
            if method == protocol.HELLO:
                result: Any = {"api_version": protocol.API_VERSION, "daemon_version": "recorder",
                               "uid": uid, "gid": 0, "pid": 0}  # fmt: skip
            elif method == protocol.STATUS:
                result = {"gpus": [{"index": 0, "uuid": GPU}], "clients": []}
            else:
                with server.lock:
                    server.requests.append((method, params, uid))
                result = {}
            self.wfile.write(protocol.encode(protocol.ok_response(msg["id"], result)))


def _serve(path: Path) -> _Recorder:
    recorder = _Recorder(path)
    threading.Thread(target=recorder.serve_forever, daemon=True).start()
    return recorder


@dataclass
class Harness:
    """The cluster, and on its API socket either the recorder or a real simulated daemon."""

    cluster: slurm_cluster.SlurmCluster
    recorder: _Recorder | None
    base: Path
    user: str | None
    daemon: subprocess.Popen[bytes] | None = None
    cgroup_dir: Path | None = None

    @property
    def socket(self) -> Path:
        return self.base / "api.sock"

    def use_recorder(self) -> _Recorder:
        self.stop_daemon()
        if self.recorder is None:
            self.recorder = _serve(self.socket)
        self.recorder.scripts_log = self.base / "scripts.log"
        self.recorder.slurmd_log = self.cluster.base / "log" / "slurmd.log"
        return self.recorder

    def stop_recorder(self) -> None:
        if self.recorder is not None:
            self.recorder.shutdown()
            self.recorder.server_close()
            self.socket.unlink(missing_ok=True)
            self.recorder = None

    def use_daemon(self) -> None:
        """``gpushare daemon --simulate 1`` on the socket the Prolog and Epilog talk to."""
        self.stop_recorder()
        if self.daemon is not None:
            return
        if self.cgroup_dir is None and cgroup_skip_reason() is None:
            self.cgroup_dir = unique_base("gs-slurm-test")
        cgroup_line = f'cgroup_base = "{self.cgroup_dir}"' if self.cgroup_dir else ""
        conf = self.base / "daemon.toml"
        conf.write_text(
            f"""version = 1
[paths]
runtime_dir = "{self.base}/run"
state_dir = "{self.base}/state"
socket = "{self.socket}"
{cgroup_line}
[daemon]
admin_group = ""
cancel_grace = "1s"
adopt_scan_period = "200ms"
adopt_min_age = "300ms"
[metrics]
enabled = false
[mps]
control_binary = "/nonexistent/gpushare-test/nvidia-cuda-mps-control"
"""
        )
        self.daemon = subprocess.Popen(
            [sys.executable, "-c", "from gpushare.cli.app import main; main()", "daemon",
             "--simulate", "1", "--config", str(conf)],
            cwd=repo_root(), stdout=subprocess.DEVNULL,
            stderr=(self.base / "daemon.log").open("wb"),
        )  # fmt: skip
        wait_for(self._answers, 30.0, "the simulated daemon")

    def _answers(self) -> bool:
        assert self.daemon is not None
        assert self.daemon.poll() is None, (self.base / "daemon.log").read_text()[-3000:]
        return self.socket.exists() and self.call("status") is not None

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        with ApiClient.connect(self.socket, timeout_s=10.0) as api:
            return api.call(method, params)

    def stop_daemon(self) -> None:
        if self.daemon is None:
            return
        if self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        self.daemon = None
        if self.cgroup_dir is not None:
            remove_tree(self.cgroup_dir)

    def job_file(self, job: str) -> Path:
        return self.base / "run" / "slurm" / f"job-{job}.json"

    def output(self, job: str) -> str:
        return (self.base / "out" / f"{job}.out").read_text()

    def sbatch(self, *args: str, wrap: str) -> str:
        done = self.cluster.run(
            "sbatch", "--parsable", "-o", f"{self.base}/out/%j.out", "--chdir", "/tmp", *args,
            "--wrap", wrap, user=self.user,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]


@pytest.fixture(scope="module")
def slurm_harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    if (reason := slurm_cluster.skip_reason()) is not None:
        pytest.skip(reason)
    # A module that sets SLURM_QOS gets accounting with those QOS, allowed to root and the user.
    qos = getattr(request.module, "SLURM_QOS", None)
    if qos is not None and (reason := slurm_accounting.skip_reason()) is not None:
        pytest.skip(reason)
    python = python_for_others()
    base = make_trusted_dir("gss-")  # the daemon refuses a config under /tmp
    (base / "out").mkdir(mode=0o777)
    (base / "out").chmod(0o1777)
    (base / "gpushare.toml").write_text(
        f'[paths]\nruntime_dir = "{base}/run"\nsocket = "{base}/api.sock"\n'
    )
    # The gpushare command the scripts run: the checkout's package, with the test's config. The
    # TaskProlog runs as the job's user, who may not enter the clone (a checkout under root's home
    # or a 0700 mktemp -d), so the package is installed as an admin would: copied under this
    # root-owned 0755 directory, not read from the clone.
    lib = install_package_for_others(base / "lib")
    launcher = base / "gpushare"
    # What the scripts print is in no log the test reads: keep it for its failure messages.
    scripts_log = base / "scripts.log"
    scripts_log.touch(mode=0o666)
    scripts_log.chmod(0o666)  # the TaskProlog runs as the job's user
    # Each run's start and exit status are logged too (a Prolog killed by a signal prints nothing).
    launcher.write_text(
        f"#!/bin/sh\nexport GPUSHARE_CONFIG={base}/gpushare.toml PYTHONPATH={lib}\n"
        f'echo "$(date +%T.%N) gpushare $* (job $SLURM_JOB_ID): start" >>{scripts_log}\n'
        f"{python or sys.executable} -c 'from gpushare.cli.fast import main; main()' \"$@\""
        f" 2>>{scripts_log}\nstatus=$?\n"
        f'echo "$(date +%T.%N) gpushare $* (job $SLURM_JOB_ID): exit $status" >>{scripts_log}\n'
        "exit $status\n"
    )
    launcher.chmod(0o755)
    scripts = {}
    # A module's SLURM_PROLOG_ARGS are added to the Prolog's command (tests/cluster/test_slurm_qos.py).
    prolog_args = getattr(request.module, "SLURM_PROLOG_ARGS", "")
    for name in ("prolog", "task-prolog", "epilog"):
        text = (repo_root() / "deploy" / "slurm" / name).read_text()
        assert "exec /usr/bin/gpushare slurm " in text
        text = text.replace("/usr/bin/gpushare", str(launcher))
        if name == "prolog" and prolog_args:
            text = text.replace(" slurm prolog", f" slurm prolog {prolog_args}")
        scripts[name] = base / name
        scripts[name].write_text(text)
        scripts[name].chmod(0o755)
    # Jobs run as nobody where nobody can run a Python with gpushare; else as root.
    user = "nobody" if python is not None and _has_nobody() else None
    acct = None
    recorder = _serve(base / "api.sock")
    try:
        acct = _accounting(qos, user)
        cluster = slurm_cluster.start(
            prolog=scripts["prolog"],
            task_prolog=scripts["task-prolog"],
            epilog=scripts["epilog"],
            # A module that sets SLURM_GRES gets a node with those GRES (test_slurm_gres.py).
            gres=getattr(request.module, "SLURM_GRES", None),
            before_slurmctld=acct[1] if acct is not None else None,
        )
    except BaseException:
        recorder.shutdown()
        recorder.server_close()
        if acct is not None:
            acct[0].stop()
        shutil.rmtree(base, ignore_errors=True)
        raise
    h = Harness(cluster, recorder, base, user)
    try:
        yield h
    finally:
        cluster.stop()
        if acct is not None:
            acct[0].stop()
        h.stop_recorder()
        h.stop_daemon()
        shutil.rmtree(base, ignore_errors=True)


def _accounting(
    qos: tuple[str, ...] | None, user: str | None
) -> tuple[slurm_accounting.Accounting, Callable[[slurm_cluster.SlurmCluster], None]] | None:
    """A started database and the hook that starts slurmdbd before slurmctld, or ``None``."""
    if qos is None:
        return None
    acct = slurm_accounting.Accounting()
    try:
        acct.start_database()
    except BaseException:
        acct.stop()
        raise

    def hook(cluster: slurm_cluster.SlurmCluster) -> None:
        acct.start_dbd(cluster)
        for name in qos:
            acct.sacctmgr("add", "qos", name)
        for who in {"root", user or "root"}:
            acct.add_user(who, "normal", *qos)

    return acct, hook


@pytest.fixture
def recorded(slurm_harness: Harness) -> Harness:
    """The cluster with the recorder on the daemon's socket."""
    slurm_harness.use_recorder()
    return slurm_harness


@pytest.fixture
def with_daemon(slurm_harness: Harness) -> Harness:
    """The cluster with a real ``gpushare daemon --simulate 1`` on the socket."""
    slurm_harness.use_daemon()
    return slurm_harness


def _has_nobody() -> bool:
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return False
    return True


def _env_of(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


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


# ------------------------------------------------------------- a real daemon adopts the jobs


def _job_clients(h: Harness, *jobs: str) -> dict[str, dict[str, Any]]:
    """The live clients adopted for each job (by ``adopted_by``)."""
    clients = h.call("status")["clients"]
    found = {j: [c for c in clients if c.get("adopted_by") == f"slurm job {j}"] for j in jobs}
    # One client per job: its task, with the task's own processes folded in (not the TaskProlog).
    assert all(len(cs) <= 1 for cs in found.values()), found
    return {j: cs[0] for j, cs in found.items() if cs}


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
