"""A torchrun-style job as one client of the real daemon: what reaches every rank today (issue 35).

``torchrun --nproc_per_node=N`` is a parent that spawns one worker per GPU with ``LOCAL_RANK``,
``RANK`` and ``WORLD_SIZE`` set. Submitted through the real CLI, the job is one client whose
cgroup (or process group, where no cgroup v2 is writable) holds the parent and every worker, so
``gpushare pause``, ``resume`` and ``cancel`` reach all ranks at once: no rank is left running
against frozen peers. Submitted with ``--gpus 8`` and each worker started through
``gpushare rank-exec`` (``torchrun --no-python``), every rank reaches its own GPU: that GPU's MPS
pipe directory, UUID, SM share and pinned-memory limit (docs/design.md §7), and ``status`` shows
the one client on every GPU it uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.daemon_helpers import REPO, DaemonProc, wait_for
from gpushare.daemon.registry import Registry
from gpushare.model import ClientClass, ClientState
from tests.fakes.fake_gpu import fake_uuid

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


#: torchrun --no-python: the parent runs ``gpushare rank-exec -- python worker`` per rank. Each
#: worker writes the variables that reach its GPU to ``env<rank>.json``, then a heartbeat.
TORCHRUN = r"""
import os, subprocess, sys
n, out = int(sys.argv[1]), sys.argv[2]
worker = (
    "import json, os, sys, time\n"
    "rank = os.environ['GPUSHARE_LOCAL_RANK']\n"
    "keys = ('LOCAL_RANK', 'GPUSHARE_LOCAL_RANK', 'RANK', 'WORLD_SIZE', 'GPUSHARE_GPU_UUID',\n"
    "        'CUDA_MPS_PIPE_DIRECTORY', 'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE',\n"
    "        'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT', 'CUDA_MPS_CLIENT_PRIORITY', 'GPUSHARE_CLIENT_ID')\n"
    "path = os.path.join(sys.argv[1], 'env' + rank + '.json')\n"
    "with open(path + '.tmp', 'w') as f: json.dump({k: os.environ.get(k) for k in keys}, f)\n"
    "os.replace(path + '.tmp', path)\n"
    "path = os.path.join(sys.argv[1], 'beat' + rank)\n"
    "i = 0\n"
    "while True:\n"
    "    i += 1\n"
    "    with open(path + '.tmp', 'w') as f: f.write(str(i))\n"
    "    os.replace(path + '.tmp', path)\n"
    "    time.sleep(0.02)\n"
)
env = dict(os.environ, WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
argv = [sys.executable, "-m", "gpushare", "rank-exec", "--", sys.executable, "-c", worker, out]
kids = [subprocess.Popen(argv, env=dict(env, LOCAL_RANK=str(k), RANK=str(k))) for k in range(n)]
with open(os.path.join(out, "pids.tmp"), "w") as f:
    f.write(" ".join(str(p.pid) for p in kids))
os.replace(os.path.join(out, "pids.tmp"), os.path.join(out, "pids"))
for p in kids:
    p.wait()
"""


def test_an_8_rank_torchrun_job_is_one_client_whose_ranks_each_reach_their_own_gpu(
    daemon: DaemonProc, tmp_path: Path
) -> None:
    out = tmp_path / "ranks"
    out.mkdir()
    done = cli(
        daemon, "submit", "--offline", "--detach", "--gpus", str(RANKS), "--mem", "2G",
        "--name", "ddp", "--", sys.executable, "-c", TORCHRUN, str(RANKS), str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    status = daemon.call("status")
    (client,) = [c for c in status["clients"] if c["name"] == "ddp"]
    cid = client["id"]
    uuids = {g["index"]: g["uuid"] for g in status["gpus"]}
    # One client on every GPU, in rank order, in status (JSON and text) and list.
    assert [(g["rank"], g["index"], g["uuid"]) for g in client["gpus"]] == [
        (k, k, uuids[k]) for k in range(RANKS)
    ]
    assert all(g["clients"] == [cid] and g["client_slots_used"] == 1 for g in status["gpus"])
    shown = cli(daemon, "list")
    assert ",".join(map(str, range(RANKS))) in shown.stdout, shown.stdout
    for k in (0, RANKS - 1):
        assert cid in cli(daemon, "list", "--gpu", str(k)).stdout

    wait_for(lambda: all((out / f"env{k}.json").exists() for k in range(RANKS)), timeout_s=30.0,
             what="every rank's environment")  # fmt: skip
    pipe_root = Path(status["daemon"]["paths"]["mps_pipe_dir"])
    pipes = set()
    for k in range(RANKS):
        env = json.loads((out / f"env{k}.json").read_text())
        assert env["GPUSHARE_GPU_UUID"] == uuids[k]
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe_root / uuids[k])
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{uuids[k]}=2G"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == f"{client['sm_pct']:g}"
        assert env["CUDA_MPS_CLIENT_PRIORITY"] == "1"
        # Its one GPU is device 0 under its MPS server; the launcher's rank is kept.
        assert (env["LOCAL_RANK"], env["GPUSHARE_LOCAL_RANK"], env["RANK"]) == ("0", str(k), str(k))
        assert env["WORLD_SIZE"] == str(RANKS) and env["GPUSHARE_CLIENT_ID"] == cid
        pipes.add(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert len(pipes) == RANKS

    pids = [int(p) for p in (out / "pids").read_text().split()]
    wait_for(lambda: all((out / f"beat{k}").exists() for k in range(RANKS)), timeout_s=20.0,
             what="every rank's first heartbeat")  # fmt: skip
    assert cli(daemon, "pause", cid).returncode == 0
    time.sleep(0.3)
    before = beats(out)
    time.sleep(0.6)
    assert beats(out) == before, "a rank kept running while its gang was paused"
    assert cli(daemon, "resume", cid).returncode == 0
    wait_for(lambda: all(a > b for a, b in zip(beats(out), before, strict=True)), timeout_s=10.0,
             what="every rank to run again")  # fmt: skip
    assert cli(daemon, "cancel", cid).returncode == 0
    wait_for(lambda: not any(alive(p) for p in pids), timeout_s=10.0, what="every rank to end")


def test_a_gang_is_placed_on_all_its_gpus_or_refused_with_each_gpus_reason(
    daemon: DaemonProc,
) -> None:
    sleep = ["sleep", "60"]
    filler = cli(daemon, "submit", "--offline", "--detach", "--gpu", "3", "--mem", "10G",
                 "--", *sleep)  # fmt: skip
    assert filler.returncode == 0, filler.stdout + filler.stderr
    before = len(daemon.call("list", {"all": True})["clients"])
    named = cli(daemon, "submit", "--offline", "--detach", "--gpus", "2,3", "--mem", "8G",
                "--no-queue", "--", *sleep)  # fmt: skip
    assert named.returncode != 0
    lines = named.stderr.strip().splitlines()
    assert len(lines) == 1 and "GPU 3:" in lines[0] and "GPU 2:" not in lines[0], named.stderr
    everything = cli(daemon, "submit", "--offline", "--detach", "--gpus", str(RANKS), "--mem",
                     "8G", "--no-queue", "--", *sleep)  # fmt: skip
    assert everything.returncode != 0 and "GPU 3:" in everything.stderr
    # Nothing was registered for either: all or nothing (without --no-queue it would wait:
    # tests/daemon/test_gang_queue.py).
    assert len(daemon.call("list", {"all": True})["clients"]) == before
    # A count goes where a rank fits: every GPU but the full one.
    seven = cli(daemon, "submit", "--offline", "--detach", "--gpus", str(RANKS - 1), "--mem",
                "8G", "--name", "seven", "--", *sleep)  # fmt: skip
    assert seven.returncode == 0, seven.stdout + seven.stderr
    gang = next(c for c in daemon.call("list")["clients"] if c["name"] == "seven")
    assert [g["index"] for g in gang["gpus"]] == [k for k in range(RANKS) if k != 3]
    # Its memory is promised on every GPU of the gang: a second one fits nowhere now.
    again = cli(daemon, "submit", "--offline", "--detach", "--gpus", "2", "--mem", "8G",
                "--no-queue", "--", *sleep)  # fmt: skip
    assert again.returncode != 0, again.stdout


def test_rank_exec_refuses_what_is_not_a_rank_of_a_gang_with_one_line() -> None:
    gang = json.dumps([{"GPUSHARE_GPU_UUID": "GPU-a"}, {"GPUSHARE_GPU_UUID": "GPU-b"}])
    cases = {
        "no gang": ({"LOCAL_RANK": "0"}, "GPUSHARE_GANG is not set"),
        "no rank": ({"GPUSHARE_GANG": gang}, "LOCAL_RANK is not set"),
        "outside": ({"GPUSHARE_GANG": gang, "LOCAL_RANK": "2"}, "not a rank of this gang (0 to 1)"),
        "not a number": ({"GPUSHARE_GANG": gang, "LOCAL_RANK": "-1"}, "not a rank of this gang"),
        "bad gang": ({"GPUSHARE_GANG": "{", "LOCAL_RANK": "0"}, "not a gang's environment"),
    }
    base = {k: v for k, v in os.environ.items() if k not in ("GPUSHARE_GANG", "LOCAL_RANK")}
    for what, (extra, words) in cases.items():
        run = subprocess.run(
            [sys.executable, "-m", "gpushare", "rank-exec", "--", "true"], cwd=REPO,
            env={**base, **extra}, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert run.returncode == 2, what
        assert run.stderr.count("\n") == 1 and words in run.stderr, (what, run.stderr)
    ok = subprocess.run(
        [sys.executable, "-m", "gpushare", "rank-exec", "--", "sh", "-c",
         'echo "$GPUSHARE_GPU_UUID $LOCAL_RANK $GPUSHARE_LOCAL_RANK"'], cwd=REPO,
        env={**base, "GPUSHARE_GANG": gang, "LOCAL_RANK": "1"},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert ok.returncode == 0 and ok.stdout == "GPU-b 0 1\n", ok.stderr


def test_bad_gang_submits_get_one_line_and_change_nothing_and_a_foreground_gang_gets_its_ranks(
    daemon: DaemonProc,
) -> None:
    cmd = ["--", "true"]
    for args, words in (
        (["--offline", "--gpus", "9"], "this node shares 8 GPUs"),
        (["--offline", "--gpus", "0"], "this node shares 8 GPUs"),
        (["--offline", "--gpus", "0,0"], "names a GPU twice"),
        (["--offline", "--gpus", "0,"], "give a count (8) or a list"),
        (["--offline", "--gpus", "0,42"], "no GPU '42'"),
        (["--offline", "--gpus", "2", "--gpu", "1"], "not with --gpu"),
        (["--online", "--gpus", "2", "--gpu", "0"], "not with --gpu"),
    ):
        run = cli(daemon, "submit", *args, *cmd)
        assert run.returncode == 2 and run.stderr.count("\n") == 1, (args, run.stderr)
        assert words in run.stderr, (args, run.stderr)
    assert daemon.call("list", {"all": True})["clients"] == []
    # In the foreground the CLI execs the launcher itself with the gang's environment.
    show = "import json, os; print(len(json.loads(os.environ['GPUSHARE_GANG'])))"
    fg = cli(daemon, "submit", "--offline", "--gpus", "3", "--", sys.executable, "-c", show)
    assert fg.returncode == 0 and fg.stdout.strip() == "3", fg.stdout + fg.stderr


def test_an_online_tp_server_is_a_gang_whose_ranks_reach_their_gpus_at_online_priority(
    daemon: DaemonProc, tmp_path: Path
) -> None:
    out = tmp_path / "ranks"
    out.mkdir()
    done = cli(
        daemon, "submit", "--online", "--detach", "--gpus", "1,2", "--mem", "4G", "--name", "tp",
        "--", sys.executable, "-c", TORCHRUN, "2", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    status = daemon.call("status")
    (client,) = [c for c in status["clients"] if c["name"] == "tp"]
    assert client["class"] == "online"
    assert [(g["rank"], g["index"]) for g in client["gpus"]] == [(0, 1), (1, 2)]
    uuids = {g["index"]: g["uuid"] for g in status["gpus"]}
    wait_for(lambda: all((out / f"env{k}.json").exists() for k in range(2)), timeout_s=30.0,
             what="every rank's environment")  # fmt: skip
    for k, index in enumerate((1, 2)):
        env = json.loads((out / f"env{k}.json").read_text())
        assert env["GPUSHARE_GPU_UUID"] == uuids[index]
        assert env["CUDA_MPS_CLIENT_PRIORITY"] == "0"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{uuids[index]}=4G"
    # An online gang is not queued: one that does not fit is refused.
    full = cli(daemon, "submit", "--online", "--detach", "--gpus", "8", "--mem", "13G",
               "--", "sleep", "60")  # fmt: skip
    assert full.returncode == 5 and "the gang of 8 GPUs does not fit" in full.stderr, full.stderr
    assert cli(daemon, "cancel", client["id"]).returncode == 0


def test_a_gang_launch_the_daemon_died_in_is_recorded_lost_not_queued_on_one_gpu() -> None:
    # The queue places one GPU per job: a gang sent back to it would start as a one-GPU client
    # with its ranks' environments still naming the other GPUs.
    d = DaemonProc(gpus=2)
    try:
        d.db.parent.mkdir(parents=True, exist_ok=True)
        reg = Registry.open(d.db)
        rec = reg.add_client(
            cls=ClientClass.OFFLINE, argv=["true"], uid=0, gid=0, user="root",
            state=ClientState.STARTING, priority=1, gpu_uuid=fake_uuid(0), gpu_index=0,
            detach=True, cwd="/",
        )  # fmt: skip
        reg.update(rec.id, gang=(fake_uuid(0), fake_uuid(1)))
        reg.close()
        d.start()
        after = d.client(rec.id)
        assert after["state"] == "lost", after
        assert [g["index"] for g in after["gpus"]] == [0, 1]
    finally:
        d.cleanup()
