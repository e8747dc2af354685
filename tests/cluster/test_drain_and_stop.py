"""``gpushare drain``/``undrain`` and ``daemon.on_stop``, on a real simulated-GPU daemon.

The daemon runs as a real process (``--simulate 1``, simulated MPS) with real cgroups where the
machine has them; it is stopped and started again to check what survives a restart.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support import trusted
from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree
from bench.support.daemon_helpers import call_as, python_for_others
from gpushare.client import ApiClient, ApiError, DaemonUnreachableError
from gpushare.paths import repo_root
from tests.support.sim_daemon_helpers import GPUSHARE, sim_config, socket_env

NO_MPS = Path("nvidia-cuda-mps-control-not-installed")  # MPS simulated: a quick start


class Node:
    """A simulated-GPU daemon that can be stopped and started again on the same state."""

    def __init__(self, daemon: str = "", rest: str = "") -> None:
        # Not /tmp: the daemon refuses a config below a directory other users may write.
        self.base = trusted.make_trusted_dir("gsd-")
        self.base.chmod(0o755)
        self.cgroup_dir = sim_config(self.base, NO_MPS, daemon=daemon, rest=rest)
        self.env = socket_env(self.base)
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock = self.base / "run" / "gpushare.sock"

    def start(self) -> None:
        argv = [
            *GPUSHARE,
            "daemon",
            "--simulate",
            "1",
            "--config",
            str(self.base / "gpushare.toml"),
        ]
        log = (self.base / "daemon.log").open("ab")
        self.proc = subprocess.Popen(argv, env=self.env, cwd=repo_root(),
                                     stdout=subprocess.DEVNULL, stderr=log)  # fmt: skip
        wait(lambda: self.proc is not None and (self.proc.poll() is not None or self.ready()),
             30, "the daemon")  # fmt: skip
        assert self.proc.poll() is None, (self.base / "daemon.log").read_text()[-2000:]

    def ready(self) -> bool:
        if not self.sock.exists():
            return False
        try:
            return bool(self.call("status")["daemon"]["ready"])
        except (OSError, ApiError, DaemonUnreachableError):
            return False

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """One API call from this process (the CLI costs a Python start-up each time)."""
        with ApiClient.connect(str(self.sock)) as api:
            return api.call(method, params or {})

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=30) == 0

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*GPUSHARE, *args], env=self.env, capture_output=True, text=True,
                              timeout=30, check=False)  # fmt: skip

    def status(self) -> dict[str, Any]:
        return dict(self.call("status"))

    def client(self, cid: str) -> dict[str, Any]:
        return next(c for c in self.status()["clients"] if c["id"] == cid)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for c in self.status()["clients"]:
                with contextlib.suppress(ApiError):
                    self.call("cancel", {"client_id": c["id"]})
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.cgroup_dir is not None:
            remove_tree(self.cgroup_dir)
        shutil.rmtree(self.base, ignore_errors=True)


def wait(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := pred():
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def node_factory() -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(daemon: str = "", rest: str = "") -> Node:
        made.append(Node(daemon, rest))
        return made[-1]

    yield make
    for n in made:
        n.close()


def _submit(node: Node, gpu: str = "0") -> dict[str, Any]:
    """An offline ``sleep 60`` on ``gpu``, through the API (the CLI is checked where it matters)."""
    return dict(node.call("submit", {
        "cls": "offline", "argv": ["sleep", "60"], "detach": True, "cwd": "/", "gpu": gpu,
        "env": {"PATH": os.environ["PATH"]},
    }))  # fmt: skip


def _refused(node: Node, gpu: str = "0") -> str:
    with pytest.raises(ApiError) as caught:
        _submit(node, gpu)
    assert caught.value.code.name == "UNAVAILABLE"
    return caught.value.message


def test_a_drained_gpu_refuses_new_work_keeps_running_work_and_stays_drained_on_restart(
    node_factory: Callable[..., Node],
):
    node = node_factory()
    node.start()
    _submit(node)
    running = [c for c in node.status()["clients"] if c["state"] in ("running", "throttled")]
    assert len(running) == 1
    cid = running[0]["id"]

    if python_for_others() is not None:
        # Draining changes what every user may do: not for an ordinary user.
        nobody = pwd.getpwnam("nobody")
        reply = call_as(nobody.pw_uid, nobody.pw_gid, node.sock, "drain", {"reason": "mine"})
        assert reply["error"] == "PERMISSION_DENIED"
        assert "only root" in reply["message"]
        assert node.status()["gpus"][0]["drain"] is None

    done = node.cli("drain", "--gpu", "0", "--reason", "driver upgrade")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "draining GPU 0: nothing new starts there"
    (gpu,) = node.status()["gpus"]
    assert gpu["drain"]["by"] == "root"
    assert gpu["drain"]["reason"] == "driver upgrade"
    assert (
        "draining (by root: driver upgrade): nothing new starts here" in node.cli("status").stdout
    )

    refused = node.cli("submit", "--offline", "--detach", "--gpu", "0", "--", "sleep", "60")
    assert refused.returncode == 1
    assert refused.stderr.startswith("gpushare: GPU 0 is draining (by root since")
    assert refused.stderr.endswith(
        ": driver upgrade): nothing new starts there; `gpushare undrain --gpu 0` ends it\n"
    )
    assert "every shared GPU is draining" in _refused(node, "any")
    # What ran there goes on.
    assert node.client(cid)["state"] in ("running", "throttled")
    events = node.call("events", {})["events"]
    assert [e["message"].endswith("drained by root: driver upgrade") for e in events].count(
        True
    ) == 1

    node.call("cancel", {"client_id": cid})
    wait(lambda: node.status()["clients"] == [], 20, "the cancel")
    node.stop()
    node.start()
    # Persisted: the restarted daemon still admits nothing there.
    assert node.status()["gpus"][0]["drain"]["reason"] == "driver upgrade"
    assert "GPU 0 is draining" in _refused(node)
    assert (node.base / "state" / "drained.json").stat().st_mode & 0o777 == 0o600

    done = node.cli("undrain")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "GPU 0 admits work again"
    assert node.status()["gpus"][0]["drain"] is None
    assert _submit(node)["state"] in ("running", "starting")


def test_a_queued_job_waits_while_its_gpu_drains_and_starts_after_undrain(
    node_factory: Callable[..., Node],
):
    # A restartable job that fails goes back to the queue; a drain must hold it there.
    node = node_factory(rest='[control]\nfailure_backoff_min = "0s"\nmax_client_failures = 1000\n')
    node.start()
    flag = node.base / "fail"
    flag.touch()
    job = node.cli(
        "submit", "--offline", "--restartable", "--gpu", "0", "--",
        "sh", "-c", f"while [ -e {flag} ]; do sleep 0.2; done; exit 1",
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    (rec,) = node.status()["clients"]
    cid = rec["id"]
    node.call("drain", {})
    flag.unlink()  # the job fails now and is requeued
    waiting = wait(lambda: node.client(cid)["waiting"], 20, "the job to queue")
    assert waiting == "GPU 0 is draining (gpushare undrain)"
    started = node.client(cid)["started_at"]
    time.sleep(1.5)  # several admission rounds
    assert node.client(cid)["state"] == "queued"
    assert node.client(cid)["started_at"] == started
    flag.touch()  # from now on it runs
    assert node.cli("undrain", "--gpu", "0").returncode == 0
    wait(lambda: node.client(cid)["state"] in ("running", "throttled", "starting"), 20, "restart")


needs_cgroups = pytest.mark.skipif(
    cgroup_skip_reason() is not None, reason=str(cgroup_skip_reason())
)


def _frozen(pid: int) -> str:
    rel = Path(f"/proc/{pid}/cgroup").read_text().split("0::", 1)[1].split("\n", 1)[0]
    mount = next(
        line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if " - cgroup2 " in line
    )  # fmt: skip
    events = (Path(mount) / rel.lstrip("/") / "cgroup.events").read_text()
    return next(line.split()[1] for line in events.splitlines() if line.startswith("frozen "))


@needs_cgroups
@pytest.mark.parametrize(("on_stop", "frozen_while_down"), [("freeze", "1"), ("thaw", "0")])
def test_on_stop_decides_whether_offline_work_runs_while_the_daemon_is_down(
    node_factory: Callable[..., Node], on_stop: str, frozen_while_down: str
):
    node = node_factory(daemon=f'on_stop = "{on_stop}"')
    node.start()
    _submit(node)
    (rec,) = node.status()["clients"]
    pid = rec["pid"]
    assert _frozen(pid) == "0"
    node.stop()
    assert _frozen(pid) == frozen_while_down
    os.kill(pid, 0)  # left running either way (KillMode=process)
    # The next daemon thaws it and its controller decides from there.
    node.start()
    wait(lambda: _frozen(pid) == "0", 10, "the thaw at start")
    assert node.client(rec["id"])["state"] in ("running", "throttled")
