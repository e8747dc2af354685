"""A queued gang that waited ``daemon.gang_reserve_after`` reserves its GPUs (docs/design.md D15).

Through the real CLI and a real daemon on two fake GPUs of 16G, as ``test_gang_queue.py``: another
user's 10G job holds GPU 0, so root's gang of two 8G ranks waits. Under the plain rule a second
job of that user would start on the free GPU 1, and the gang would wait behind it too; once the
gang has waited, GPU 1 is reserved for it: the user's job queued for GPU 1 waits (saying why), a
``--no-queue`` submit there is refused, ``list`` shows the reservation, and when GPU 0 frees the
gang starts on both GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.accounts import Account
from bench.support.daemon_helpers import REPO, DaemonProc, call_as, wait_for
from tests.daemon.test_gang_launch import TORCHRUN


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc(gpus=2, daemon_toml='gang_reserve_after = "2s"').start()
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


def submit_as(a: Account, d: DaemonProc, gpu: str, **extra: object) -> dict[str, Any]:
    job = {"cls": "offline", "argv": ["sleep", "60"], "detach": True, "cwd": "/",
           "env": {"PATH": os.environ["PATH"]}, "mem_bytes": 10 << 30, "gpu": gpu, **extra}  # fmt: skip
    return call_as(a.uid, a.gid, d.socket, "submit", job)


def test_a_waiting_gang_reserves_the_free_gpu_and_starts_when_the_other_frees(
    daemon: DaemonProc, accounts: tuple[Account, Account, Account], tmp_path: Path
) -> None:
    d, (a, _, _) = daemon, accounts
    filler = submit_as(a, d, "0")["result"]["client_id"]
    out = tmp_path / "ranks"
    out.mkdir()
    queued = cli(d, "submit", "--offline", "--detach", "--gpus", "2", "--mem", "8G",
                 "--", sys.executable, "-c", TORCHRUN, "2", str(out))  # fmt: skip
    assert queued.returncode == 0, queued.stderr
    cid = queued.stdout.split()[0]
    assert clients(d)[cid]["state"] == "queued"
    # Once it has waited 2 s the gang reserves GPUs 0 and 1.
    wait_for(lambda: (clients(d)[cid]["waiting"] or "").startswith("reserving GPUs 0,1 since"),
             timeout_s=15.0, what="the gang's reservation")  # fmt: skip
    assert "reserving GPUs 0,1 since" in cli(d, "list").stdout
    # Another job of that user, for the free GPU 1: queued behind the gang (it fits, but jobs
    # wait), and under the plain rule the next round would start it there; now it waits.
    later = submit_as(a, d, "1")["result"]
    assert later["state"] == "queued", later
    wait_for(lambda: "reserved for the gang" in (clients(d)[later["client_id"]]["waiting"] or ""),
             timeout_s=10.0, what="the reason the job on GPU 1 waits")  # fmt: skip
    assert clients(d)[later["client_id"]]["state"] == "queued"
    refused = submit_as(a, d, "1", no_queue=True)
    assert refused.get("error") == "NO_CAPACITY", refused
    assert f"reserved for the waiting gang {cid}" in refused["message"], refused
    # GPU 0 frees: the gang takes both GPUs at once; the job for GPU 1 no longer fits there.
    assert cli(d, "cancel", filler).returncode == 0
    wait_for(lambda: clients(d)[cid]["state"] == "running", timeout_s=20.0, what="the gang")
    assert [g["index"] for g in clients(d)[cid]["gpus"]] == [0, 1]
    assert clients(d)[later["client_id"]]["state"] == "queued"
    assert cli(d, "cancel", cid).returncode == 0
    assert cli(d, "cancel", later["client_id"]).returncode == 0
