"""A torchrun job started outside gpushare is adopted as one gang client (issue 35).

Its workers carry the adoption marker, their GPU, ``LOCAL_RANK`` and the elastic agent's
``TORCHELASTIC_RUN_ID``; the real daemon's scan makes them one client through their common
parent, on every rank's GPU in rank order, so ``pause`` stops every rank at once. Every local
user is an attacker and the environment is theirs to write: another user's process with the same
run id never joins the gang, nor do ranks of two users under a root-owned parent (a
``slurmstepd``): those are adopted one process at a time, as before (docs/security.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.accounts import Account
from bench.support.daemon_helpers import DaemonProc, wait_for
from tests.fakes.fake_gpu import fake_uuid

FAST = 'adopt_scan_period = "100ms"\nadopt_min_age = "200ms"'
TOKEN = uuid.uuid4().hex  # the rule adopts this test's processes only
RULE = f'[[adopt]]\nname = "ddp"\nmarker = true\nenv = {{ GSTEST_GANG = "{TOKEN}" }}\n'


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=5)


def launch(
    started: list[subprocess.Popen[bytes]],
    run_id: str,
    ranks: list[tuple[int, int, str]],
    user: Account | None = None,
) -> tuple[int, list[int]]:
    """A torchrun-like parent (``sh``) and its workers: (local rank, GPU, prefix) each.

    The parent's own environment has no marker: only its workers are adopted by the rule.
    """
    lines = [
        f"GPUSHARE_CLASS=offline GPUSHARE_GPU_UUID={fake_uuid(gpu)} LOCAL_RANK={k} "
        f"TORCHELASTIC_RUN_ID={run_id} {prefix}sleep 60 &"
        for k, gpu, prefix in ranks
    ]
    proc = subprocess.Popen(
        ["sh", "-c", "\n".join([*lines, "wait"])], cwd="/", start_new_session=True,
        env={"PATH": os.environ["PATH"], "GSTEST_GANG": TOKEN},
        user=user.uid if user else None, group=user.gid if user else None,
        extra_groups=[] if user else None,
    )  # fmt: skip
    started.append(proc)
    kids = wait_for(lambda: _sleeping_children(proc.pid, len(ranks)), 10.0, "the workers")
    return proc.pid, kids


def _sleeping_children(pid: int, n: int) -> list[int] | None:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    kids = [int(k) for k in path.read_text().split()]
    if len(kids) < n:
        return None
    ok = all(Path(f"/proc/{k}/cmdline").read_bytes() == b"sleep\x0060\x00" for k in kids)
    return sorted(kids) if ok else None


def _state(pid: int) -> str:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rfind(")") + 2]


def by_pid(d: DaemonProc) -> dict[int, dict[str, Any]]:
    return {c["pid"]: c for c in d.call("status")["clients"] if c["pid"] is not None}


def test_a_torchrun_jobs_ranks_are_adopted_as_one_gang_and_no_other_user_joins_it(
    started: list[subprocess.Popen[bytes]], accounts: tuple[Account, Account, Account]
) -> None:
    a, b, _ = accounts
    d = DaemonProc(RULE, gpus=4, daemon_toml=FAST)
    try:
        d.start()
        run = uuid.uuid4().hex
        # A's job: rank 0 on GPU 2, rank 1 on GPU 0.
        parent, ranks = launch(started, run, [(0, 2, ""), (1, 0, "")], user=a)
        gang = wait_for(lambda: by_pid(d).get(parent), 15.0, "A's job adopted as one gang")
        assert (gang["user"], gang["class"], gang["state"]) == (a.name, "offline", "running")
        assert [(g["rank"], g["index"]) for g in gang["gpus"]] == [(0, 2), (1, 0)]
        assert gang["adopted_by"] == f"rule 'ddp' ({d.config_path})"
        assert not set(ranks) & set(by_pid(d)), "a rank of the gang was adopted on its own"
        d.call("pause", {"client_id": gang["id"]})
        assert [_state(p) for p in ranks] == ["T", "T"], "a rank ran on while its gang was paused"
        d.call("resume", {"client_id": gang["id"]})
        wait_for(lambda: all(_state(p) != "T" for p in ranks), 5.0, "every rank to run again")

        # B copies A's run id and takes rank 2 on GPU 3: its own process, not A's gang.
        _, (mine,) = launch(started, run, [(2, 3, "")], user=b)
        alone = wait_for(lambda: by_pid(d).get(mine), 15.0, "B's process adopted")
        assert alone["user"] == b.name and [g["index"] for g in alone["gpus"]] == [3]
        # Two users' tasks under one root-owned parent (a slurmstepd), same run id: never a gang.
        root_parent, mixed = launch(
            started, run,
            [(0, 1, f"setpriv --reuid={a.uid} --regid={a.gid} --clear-groups "),
             (1, 3, f"setpriv --reuid={b.uid} --regid={b.gid} --clear-groups ")],
        )  # fmt: skip
        wait_for(lambda: set(mixed) <= set(by_pid(d)), 15.0, "the mixed tasks adopted one by one")
        clients = by_pid(d)
        assert root_parent not in clients
        assert sorted(clients[p]["user"] for p in mixed) == sorted([a.name, b.name])
        assert all(len(clients[p]["gpus"]) == 1 for p in mixed)
        again = clients[parent]
        assert again["id"] == gang["id"] and [g["index"] for g in again["gpus"]] == [2, 0]
    finally:
        d.cleanup()


def test_ranks_on_one_gpu_or_without_a_common_parent_of_their_owner_stay_separate_clients(
    started: list[subprocess.Popen[bytes]], accounts: tuple[Account, Account, Account]
) -> None:
    a, _, _ = accounts
    d = DaemonProc(RULE, gpus=4, daemon_toml=FAST)
    try:
        d.start()
        # Two ranks on the same GPU are not a DDP job's layout: no gang.
        parent, ranks = launch(started, uuid.uuid4().hex, [(0, 1, ""), (1, 1, "")], user=a)
        wait_for(lambda: set(ranks) <= set(by_pid(d)), 15.0, "the ranks adopted one by one")
        assert parent not in by_pid(d)
    finally:
        d.cleanup()
