"""A restartable gang (``submit --gpus N --restartable``) restarted as one (issue 35).

Real daemon (in-process: registry, socket, exit watcher, signal pauser) on fake GPUs, a policy
scripted per GPU standing in for each GPU's controller, and a torchrun-style launcher that spawns
one worker per GPU through ``gpushare rank-exec`` with ``LOCAL_RANK``. On SIGTERM the launcher
passes it on and waits a while for its workers, as torchrun does, then exits; rank 1 ignores
SIGTERM, a straggler its launcher leaves behind. A restart stops every rank (rank 0 saves in the
grace) before the gang is launched once again with every rank's environment at the new share, and
at no sampled point does a rank of the old launch run beside one of the new. The same holds when
an MPS recovery on one of its GPUs sends the gang back to the queue, and when its launcher dies
with its ranks still running: the gang is relaunched whole, on all its GPUs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.support.daemon_helpers import REPO, DaemonProc
from gpushare import config
from gpushare.daemon.core import Daemon
from gpushare.daemon.registry import Registry
from gpushare.daemon.server import Caller
from gpushare.model import Action, ClientState, Observation, RecoverMps, RestartClient
from gpushare.node.signal_pauser import SignalPauser
from tests.fakes.fake_gpu import FakeGpuBackend, fake_uuid
from tests.fakes.fake_mps import FakeMpsNode
from tests.support.actions_daemon import stop_daemon

ROOT = Caller(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())
G0, G1 = fake_uuid(0), fake_uuid(1)

#: Each worker logs ``start <launcher pid> <rank> <pid>``, writes the variables that reach its
#: GPU to ``env<launcher pid>_<rank>.json``, and on SIGTERM saves (``saved ...``) and exits;
#: rank 1 ignores SIGTERM.
LAUNCHER = r"""
import os, signal, subprocess, sys, time
n, out = int(sys.argv[1]), sys.argv[2]
worker = (
    "import json, os, signal, sys, time\n"
    "out, me, rank = sys.argv[1], os.environ['LAUNCHER'], os.environ['GPUSHARE_LOCAL_RANK']\n"
    "def log(what):\n"
    "    with open(os.path.join(out, 'log'), 'a') as f: f.write(f'{what} {me} {rank} {os.getpid()}\\n')\n"
    "def save(*_):\n"
    "    time.sleep(0.2)\n"
    "    log('saved')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN if rank == '1' else save)\n"
    "keys = ('GPUSHARE_GPU_UUID', 'CUDA_MPS_PIPE_DIRECTORY', 'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE',\n"
    "        'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT', 'LOCAL_RANK')\n"
    "path = os.path.join(out, f'env{me}_{rank}.json')\n"
    "with open(path + '.tmp', 'w') as f: json.dump({k: os.environ.get(k) for k in keys}, f)\n"
    "os.replace(path + '.tmp', path)\n"
    "log('start')\n"
    "while True: time.sleep(0.01)\n"
)
env = dict(os.environ, WORLD_SIZE=str(n), LAUNCHER=str(os.getpid()))
argv = [sys.executable, "-m", "gpushare", "rank-exec", "--", sys.executable, "-c", worker, out]
kids = [subprocess.Popen(argv, env=dict(env, LOCAL_RANK=str(k), RANK=str(k))) for k in range(n)]
def stop(*_):
    for p in kids:
        p.send_signal(signal.SIGTERM)
    end = time.monotonic() + 0.6
    while time.monotonic() < end and any(p.poll() is None for p in kids):
        time.sleep(0.02)
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
if os.path.exists(os.path.join(out, "crash")):  # dies once, its workers left running
    while not all(os.path.exists(os.path.join(out, f"env{os.getpid()}_{k}.json")) for k in range(n)):
        time.sleep(0.02)
    os.remove(os.path.join(out, "crash"))
    os._exit(3)
for p in kids:
    p.wait()
"""


class PerGpuPolicy:
    """Each GPU's controller returns the actions queued for that GPU at its next step."""

    name = "per-gpu"
    offline_mps_priority = 1
    gpu_mode = "mps"
    preemption = None

    def __init__(self) -> None:
        self.pending: dict[str, list[Action]] = {}
        self.seen: dict[str, Observation] = {}

    def initial_state(self, gpu_uuid: str, now: float) -> int:
        return 0

    def step(
        self, state: int, observation: Observation, now: float
    ) -> tuple[int, Sequence[Action]]:
        self.seen[observation.gpu_uuid] = observation
        return state + 1, self.pending.pop(observation.gpu_uuid, [])


@pytest.fixture
def env() -> Iterator[tuple[Daemon, PerGpuPolicy, Path]]:
    base = Path(tempfile.mkdtemp(prefix="gsr-", dir="/tmp"))
    cfg = config.loads(f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
[daemon]
cancel_grace = "2s"
[control]
period = "50ms"
evict_grace = "1s"
failure_backoff_min = "200ms"
[probe]
enabled = false
""")
    policy = PerGpuPolicy()
    d = Daemon(
        cfg, registry=Registry.open(cfg.paths.resolved("database")), gpu=FakeGpuBackend(gpus=2),
        mps=FakeMpsNode(pipe_root=base / "mps"), pauser=SignalPauser(), policy=policy,
        notify=lambda *f: True,
    )  # fmt: skip
    d.start()
    out = base / "out"
    out.mkdir()
    out.chmod(0o777)
    try:
        yield d, policy, out
    finally:
        for _, _, _, pid in _log(out):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stop_daemon(d)
        shutil.rmtree(base, ignore_errors=True)


def _log(out: Path) -> list[tuple[str, int, int, int]]:
    path = out / "log"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(w, int(a), int(b), int(c)) for w, a, b, c in (ln.split() for ln in lines)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone, or going while read
        return False
    return state != "Z"


def _tick_until(d: Daemon, ready: Any, what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        d.run(max_ticks=1)


def _submit_gang(d: Daemon, out: Path) -> tuple[str, int, set[int]]:
    """The gang on GPUs 0 and 1, once both its ranks run: its id, launcher and workers' pids."""
    params = {
        "cls": "offline", "argv": [sys.executable, "-c", LAUNCHER, "2", str(out)],
        "detach": True, "restartable": True, "cwd": str(REPO), "gpus": "0,1", "mem_bytes": 1 << 30,
        "checkpoint_signal": int(signal.SIGTERM),  # --checkpoint-signal TERM: torchrun passes it on
        "env": {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)},
    }  # fmt: skip
    gang = d.api.submit(ROOT, params)
    _tick_until(d, lambda: len(_log(out)) == 2, "both ranks of the first launch")
    return gang["client_id"], gang["pid"], {pid for _, _, _, pid in _log(out)}


class Relaunched:
    """Sampled each tick: never a rank (or the launcher) of the old launch beside one of the new."""

    def __init__(self, out: Path, first: int, old: set[int]) -> None:
        self.out, self.first, self.old, self.samples = out, first, old, 0

    def __call__(self) -> bool:
        started = [(launcher, pid) for w, launcher, _, pid in _log(self.out) if w == "start"]
        new = [pid for launcher, pid in started if launcher != self.first]
        running_old = [p for p in (*self.old, self.first) if _alive(p)]
        running_new = [p for p in new if _alive(p)]
        assert not (running_old and running_new), (running_old, running_new)
        self.samples += 1
        return len(new) == 2


def _check_ranks(out: Path, pid: int, sm: str) -> None:
    """Every rank of the launch ``pid`` reached its own GPU at the share ``sm``."""
    for rank, uuid in enumerate((G0, G1)):
        seen = json.loads((out / f"env{pid}_{rank}.json").read_text())
        assert seen["GPUSHARE_GPU_UUID"] == uuid and seen["LOCAL_RANK"] == "0"
        assert seen["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == sm
        assert seen["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{uuid}=1G"
        assert seen["CUDA_MPS_PIPE_DIRECTORY"].endswith(uuid), seen


def test_a_restartable_gang_is_restarted_whole_and_launched_once_at_the_new_share(
    env: tuple[Daemon, PerGpuPolicy, Path],
) -> None:
    d, policy, out = env
    cid, first, old = _submit_gang(d, out)
    # Both GPUs' controllers ask for the restart in the same tick: it is one restart.
    policy.pending = {
        G0: [RestartClient(cid, 40.0, "share")],
        G1: [RestartClient(cid, 40.0, "share")],
    }
    relaunched = Relaunched(out, first, old)
    _tick_until(d, relaunched, "the gang's relaunch")
    assert relaunched.samples > 5
    assert not any(_alive(p) for p in old)
    # Rank 0 saved in the grace; the straggler its launcher left was killed, not left running.
    assert [
        (w, rank) for w, launcher, rank, _ in _log(out) if launcher == first and w == "saved"
    ] == [("saved", 0)]
    rec = d.registry.get(cid)
    assert (rec.state, rec.restarts, rec.sm_pct, rec.gpus()) == (
        ClientState.RUNNING,
        1,
        40.0,
        (G0, G1),
    )
    _check_ranks(out, rec.pid, "40")


def test_a_restartable_gang_an_mps_recovery_removes_goes_back_to_the_queue_as_a_gang(
    env: tuple[Daemon, PerGpuPolicy, Path],
) -> None:
    d, policy, out = env
    cid, first, old = _submit_gang(d, out)
    sm = d.registry.get(cid).sm_pct
    # A fault on rank 1's GPU alone: the whole gang goes, requeued, and starts again on both.
    policy.pending = {G1: [RecoverMps(G1, "test fault")]}
    relaunched = Relaunched(out, first, old)
    _tick_until(d, relaunched, "the gang's relaunch from the queue")
    rec = d.registry.get(cid)
    assert (rec.state, rec.gpus(), rec.failures) == (ClientState.RUNNING, (G0, G1), 0)
    assert rec.pid is not None
    _check_ranks(out, rec.pid, f"{sm:g}")


def test_a_restartable_gang_whose_launcher_dies_is_relaunched_whole_from_the_queue(
    env: tuple[Daemon, PerGpuPolicy, Path],
) -> None:
    d, _, out = env
    (out / "crash").touch()
    cid, first, old = _submit_gang(d, out)
    # The launcher exits 3 with both workers running: they are killed before the retry.
    relaunched = Relaunched(out, first, old)
    _tick_until(d, relaunched, "the gang's retry")
    rec = d.registry.get(cid)
    assert (rec.state, rec.gpus(), rec.failures) == (ClientState.RUNNING, (G0, G1), 1)
    assert rec.pid is not None
    _check_ranks(out, rec.pid, f"{rec.sm_pct:g}")


def test_each_gpus_controller_sees_the_gangs_other_gpus_share_and_it_starts_at_the_smallest(
    env: tuple[Daemon, PerGpuPolicy, Path],
) -> None:
    d, policy, _ = env
    d.state.set_offline_share(G0, 80.0)
    d.state.set_offline_share(G1, 35.0)
    params = {"cls": "offline", "argv": ["sleep", "60"], "detach": True, "restartable": True,
              "cwd": "/", "gpus": "0,1", "env": {"PATH": os.environ["PATH"]}}  # fmt: skip
    cid = d.api.submit(ROOT, params)["client_id"]
    # Started at the smallest share of its GPUs, as the queue's admission starts a gang.
    assert d.registry.get(cid).sm_pct == 35.0
    d.run(max_ticks=1)
    shares = {
        gpu: next(c.gang_share_pct for c in policy.seen[gpu].clients if c.client_id == cid)
        for gpu in (G0, G1)
    }
    assert shares == {G0: 35.0, G1: 80.0}
    # A share changes with no record changing: the next tick's views have it.
    d.state.set_offline_share(G1, 60.0)
    d.run(max_ticks=1)
    seen = next(c for c in policy.seen[G0].clients if c.client_id == cid)
    assert seen.gang_share_pct == 60.0


def test_the_cli_submits_a_restartable_gang() -> None:
    d = DaemonProc(gpus=2).start()
    try:
        run = subprocess.run(
            [sys.executable, "-m", "gpushare", "submit", "--offline", "--gpus", "2",
             "--restartable", "--name", "rg", "--", "sleep", "60"], cwd=REPO,
            env={**os.environ, "GPUSHARE_SOCKET": str(d.socket)},
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        (client,) = [c for c in d.call("list")["clients"] if c["name"] == "rg"]
        assert client["restartable"] and [g["index"] for g in client["gpus"]] == [0, 1], client
    finally:
        d.cleanup()
