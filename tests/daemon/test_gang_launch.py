"""A torchrun-style job as one client of the real daemon: what reaches every rank today (issue 35).

``torchrun --nproc_per_node=N`` is a parent that spawns one worker per GPU with ``LOCAL_RANK``,
``RANK`` and ``WORLD_SIZE`` set. Submitted through the real CLI, the job is one client whose
cgroup (or process group, where no cgroup v2 is writable) holds the parent and every worker, so
``gpushare pause``, ``resume`` and ``cancel`` reach all ranks at once: no rank is left running
against frozen peers. What is not built yet (docs/design.md §7): each rank reaching its own GPU's
MPS daemon, and ``status`` showing the client on every GPU it uses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.daemon_helpers import REPO, DaemonProc, wait_for

RANKS = 8
#: The launcher: N workers, each writing a heartbeat (a counter) to its own file every 20 ms.
LAUNCHER = r"""
import os, subprocess, sys
n, out = int(sys.argv[1]), sys.argv[2]
worker = (
    "import os, sys, time\n"
    "path = os.path.join(sys.argv[1], 'beat' + os.environ['LOCAL_RANK'])\n"
    "i = 0\n"
    "while True:\n"
    "    i += 1\n"
    "    with open(path + '.tmp', 'w') as f: f.write(str(i))\n"
    "    os.replace(path + '.tmp', path)\n"
    "    time.sleep(0.02)\n"
)
env = dict(os.environ, WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
kids = [
    subprocess.Popen([sys.executable, "-c", worker, out], env=dict(env, LOCAL_RANK=str(k), RANK=str(k)))
    for k in range(n)
]
with open(os.path.join(out, "pids.tmp"), "w") as f:
    f.write(" ".join(str(p.pid) for p in kids))
os.replace(os.path.join(out, "pids.tmp"), os.path.join(out, "pids"))
for p in kids:
    p.wait()
"""


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc(gpus=RANKS).start()
    yield d
    d.cleanup()


def cli(d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpushare", *args], cwd=REPO,
        env={**os.environ, "GPUSHARE_SOCKET": str(d.socket)},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


def beats(out: Path) -> list[int]:
    return [int((out / f"beat{k}").read_text() or 0) for k in range(RANKS)]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_pause_resume_and_cancel_reach_every_rank_of_a_torchrun_style_job(
    daemon: DaemonProc, tmp_path: Path
) -> None:
    out = tmp_path / "ranks"
    out.mkdir()
    done = cli(
        daemon, "submit", "--offline", "--detach", "--name", "ddp", "--",
        sys.executable, "-c", LAUNCHER, str(RANKS), str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    cid = next(c["id"] for c in daemon.call("list", {"all": True})["clients"] if c["name"] == "ddp")
    pids = wait_for(
        lambda: (out / "pids").exists() and [int(p) for p in (out / "pids").read_text().split()],
        timeout_s=20.0,
        what="the launcher's workers",
    )
    assert len(pids) == RANKS
    for k, pid in enumerate(pids):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"LOCAL_RANK={k}".encode() in environ
    wait_for(lambda: all((out / f"beat{k}").exists() for k in range(RANKS)), timeout_s=20.0,
             what="every rank's first heartbeat")  # fmt: skip

    paused = cli(daemon, "pause", cid)
    assert paused.returncode == 0, paused.stdout + paused.stderr
    time.sleep(0.3)  # a write under way when the freeze came lands
    before = beats(out)
    time.sleep(0.6)
    assert beats(out) == before, "a rank kept running while its job was paused"

    resumed = cli(daemon, "resume", cid)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    wait_for(lambda: all(a > b for a, b in zip(beats(out), before, strict=True)), timeout_s=10.0,
             what="every rank to run again")  # fmt: skip

    cancelled = cli(daemon, "cancel", cid)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    wait_for(lambda: not any(alive(p) for p in pids), timeout_s=10.0, what="every rank to end")
