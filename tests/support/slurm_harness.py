"""The harness of the tests on a real single-node Slurm (tests/support/slurm_cluster.py).

On the daemon's socket sits either a recorder speaking the daemon's protocol, so the tests check
exactly what the Prolog, TaskProlog and Epilog send, or a real ``gpushare daemon --simulate 1``,
which adopts the jobs' processes, controls them and releases them (:class:`Harness`). The fixtures
that start it are tests/cluster/conftest.py's.
"""

from __future__ import annotations

import json
import pwd
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from bench.support.daemon_helpers import wait_for
from gpushare import protocol
from gpushare.client import ApiClient
from gpushare.paths import repo_root
from tests.cluster import slurm_accounting
from tests.support import slurm_cluster

GPU = "GPU-8a2f1c3e-1111-2222-3333-444455556666"


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


def _has_nobody() -> bool:
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return False
    return True


def _env_of(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def _job_clients(h: Harness, *jobs: str) -> dict[str, dict[str, Any]]:
    """The live clients adopted for each job (by ``adopted_by``)."""
    clients = h.call("status")["clients"]
    found = {j: [c for c in clients if c.get("adopted_by") == f"slurm job {j}"] for j in jobs}
    # One client per job: its task, with the task's own processes folded in (not the TaskProlog).
    assert all(len(cs) <= 1 for cs in found.values()), found
    return {j: cs[0] for j, cs in found.items() if cs}
