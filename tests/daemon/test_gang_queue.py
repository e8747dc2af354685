"""A gang that does not fit waits in the offline queue and starts on all its GPUs at once (issue 35).

Through the real CLI and a real daemon on fake GPUs, as ``test_gang_launch.py``: an ``--offline
--gpus`` submit that finds too few GPUs with room is recorded ``queued`` (``--no-queue`` still
refuses it with each GPU's reason), shown with its place and why it waits in ``status`` and
``list``, kept across a daemon restart, and started by the admission round only when every GPU it
needs fits a rank: then every rank reaches its own GPU, as for a gang placed at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.daemon_helpers import REPO, DaemonProc, wait_for
from bench.support.observations import job
from gpushare.daemon.cordon import held_by_drain
from gpushare.daemon.registry import Registry
from gpushare.model import ClientClass, ClientState
from tests.daemon.test_gang_launch import TORCHRUN
from tests.fakes.fake_gpu import FakeGpuBackend, fake_uuid

GPUS = 4


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc(gpus=GPUS).start()
    yield d
    d.cleanup()


def cli(d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpushare", *args], cwd=REPO,
        env={**os.environ, "GPUSHARE_SOCKET": str(d.socket), "NO_COLOR": "1"},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


def clients(d: DaemonProc) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in d.call("list", {"all": True})["clients"]}


def fill(d: DaemonProc, gpu: int) -> str:
    """A 10G job on one GPU: a rank of 8G no longer fits there (16G, 2G kept for online)."""
    run = cli(d, "submit", "--offline", "--detach", "--gpu", str(gpu), "--mem", "10G",
              "--", "sleep", "60")  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout.split()[0]


def gang(d: DaemonProc, spec: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    n = len(spec.split(",")) if "," in spec else int(spec)
    return cli(
        d, "submit", "--offline", "--detach", "--gpus", spec, "--mem", "8G", "--name", "ddp",
        *extra, "--", sys.executable, "-c", TORCHRUN, str(n), str(out),
    )  # fmt: skip


def ranks_reach(d: DaemonProc, cid: str, out: Path, indices: list[int]) -> None:
    """Every rank of the started gang runs with its own GPU's MPS variables."""
    status = d.call("status")
    uuids = {g["index"]: g["uuid"] for g in status["gpus"]}
    pipes = Path(status["daemon"]["paths"]["mps_pipe_dir"])
    wait_for(lambda: all((out / f"env{k}.json").exists() for k in range(len(indices))),
             timeout_s=30.0, what="every rank's environment")  # fmt: skip
    for k, index in enumerate(indices):
        env = json.loads((out / f"env{k}.json").read_text())
        assert env["GPUSHARE_CLIENT_ID"] == cid
        assert env["GPUSHARE_GPU_UUID"] == uuids[index]
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipes / uuids[index])
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{uuids[index]}=8G"


def test_a_gang_that_does_not_fit_waits_in_the_queue_and_starts_on_all_its_gpus_at_once(
    daemon: DaemonProc, tmp_path: Path
) -> None:
    d = daemon
    filler = fill(d, 3)
    # --no-queue: refused with each GPU's reason, nothing registered.
    refused = gang(d, str(GPUS), tmp_path, "--no-queue")
    assert refused.returncode == 5 and refused.stderr.count("\n") == 1, refused.stderr
    assert "the gang of 4 GPUs does not fit (3 fit): GPU 3:" in refused.stderr, refused.stderr
    # Never: more ranks' memory than a GPU ever has beside its online reserve.
    never = cli(d, "submit", "--offline", "--detach", "--gpus", "2", "--mem", "15G",
                "--", "true")  # fmt: skip
    assert never.returncode == 5 and "needs 17G" in never.stderr, never.stderr
    assert sorted(clients(d)) == [filler]

    out = tmp_path / "ranks"
    out.mkdir()
    queued = gang(d, str(GPUS), out)
    assert queued.returncode == 0, queued.stderr
    cid = queued.stdout.split()[0]
    assert queued.stdout.startswith(f"{cid} queued (position 1)"), queued.stdout
    rec = clients(d)[cid]
    assert (rec["state"], rec["queue_position"]) == ("queued", 1)
    assert rec["pid"] is None and not (out / "pids").exists(), "nothing of a queued gang runs"
    # The admission round says why it waits, in status and list.
    wait_for(lambda: "gang of 4 GPUs fits on 3" in (clients(d)[cid]["waiting"] or ""),
             timeout_s=10.0, what="the admission round's reason")  # fmt: skip
    status = json.loads(cli(d, "status", "--json").stdout)
    assert {c["id"]: c["state"] for c in status["clients"]}[cid] == "queued"
    assert "gang of 4 GPUs fits on 3" in cli(d, "list").stdout

    # GPU 3 frees: the gang starts on every GPU at once, each rank on its own.
    assert cli(d, "cancel", filler).returncode == 0
    wait_for(lambda: clients(d)[cid]["state"] == "running", timeout_s=20.0, what="the gang")
    started = clients(d)[cid]
    assert [g["index"] for g in started["gpus"]] == list(range(GPUS))
    ranks_reach(d, cid, out, list(range(GPUS)))
    assert cli(d, "cancel", cid).returncode == 0


def test_a_queued_gang_keeps_the_gpus_it_named_and_its_place_across_a_daemon_restart(
    daemon: DaemonProc, tmp_path: Path
) -> None:
    d = daemon
    filler = fill(d, 3)
    out = tmp_path / "ranks"
    out.mkdir()
    queued = gang(d, "3,1", out)  # rank 0 on GPU 3, rank 1 on GPU 1
    assert queued.returncode == 0 and " queued " in queued.stdout, queued.stdout + queued.stderr
    cid = queued.stdout.split()[0]
    d.stop()
    d.start()
    assert clients(d)[cid]["state"] == "queued"
    # GPUs 0 and 2 fit, but it named 3 and 1: it waits for 3.
    wait_for(lambda: "GPU 3:" in (clients(d)[cid]["waiting"] or ""), timeout_s=10.0,
             what="the admission round's reason")  # fmt: skip
    assert clients(d)[cid]["state"] == "queued"
    assert cli(d, "cancel", filler).returncode == 0
    wait_for(lambda: clients(d)[cid]["state"] == "running", timeout_s=20.0, what="the gang")
    assert [g["index"] for g in clients(d)[cid]["gpus"]] == [3, 1]
    ranks_reach(d, cid, out, [3, 1])


def test_a_foreground_gang_waits_then_gets_every_ranks_environment(daemon: DaemonProc) -> None:
    d = daemon
    filler = fill(d, 0)
    show = "import json, os; print([g['GPUSHARE_GPU_UUID'] for g in json.loads(os.environ['GPUSHARE_GANG'])])"
    waiter = subprocess.Popen(
        [sys.executable, "-m", "gpushare", "submit", "--offline", "--gpus", str(GPUS), "--mem",
         "8G", "--", sys.executable, "-c", show],
        cwd=REPO, env={**os.environ, "GPUSHARE_SOCKET": str(d.socket), "NO_COLOR": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: any(c["state"] == "queued" for c in clients(d).values()),
                 timeout_s=15.0, what="the foreground gang to queue")  # fmt: skip
        assert cli(d, "cancel", filler).returncode == 0
        stdout, stderr = waiter.communicate(timeout=30)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    assert waiter.returncode == 0, stderr
    assert stdout.strip() == str([fake_uuid(k) for k in range(GPUS)]), stdout + stderr


def test_a_gang_launch_the_daemon_died_in_goes_back_to_the_queue_as_a_gang(
    tmp_path: Path,
) -> None:
    # A record that keeps its gang's request (gpu_request "gpus=2") is queued again as a gang
    # and started on two GPUs, its ranks' environments naming both.
    d = DaemonProc(gpus=2)
    out = tmp_path / "ranks"
    out.mkdir()
    try:
        d.db.parent.mkdir(parents=True, exist_ok=True)
        reg = Registry.open(d.db)
        rec = reg.add_client(
            cls=ClientClass.OFFLINE, argv=[sys.executable, "-c", TORCHRUN, "2", str(out)],
            uid=0, gid=0, user="root", state=ClientState.STARTING, priority=1,
            gpu_uuid=fake_uuid(1), gpu_index=1, gpu_request="gpus=2", mem_bytes=8 << 30,
            detach=True, cwd="/",
        )  # fmt: skip
        reg.update(rec.id, gang=(fake_uuid(1), fake_uuid(0)))
        reg.close()
        d.start()
        wait_for(lambda: d.client(rec.id)["state"] == "running", timeout_s=20.0,
                 what="the gang started again")  # fmt: skip
        assert [g["index"] for g in d.client(rec.id)["gpus"]] == [0, 1]
        ranks_reach(d, rec.id, out, [0, 1])
    finally:
        d.cleanup()


def test_a_queued_gang_that_named_a_draining_gpu_says_so() -> None:
    samples = list(FakeGpuBackend(gpus=2).sample())
    waiting = dataclasses.replace(job("c1"), ranks=2, gang_gpus=(fake_uuid(0), fake_uuid(1)))
    why = held_by_drain([waiting], {"c1": "cannot start"}, samples, {fake_uuid(1)}, {})
    assert why == {"c1": "GPU 1 is draining (gpushare undrain)"}
