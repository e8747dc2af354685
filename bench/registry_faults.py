"""Faults injected into a real daemon's registry, and the clients lost (must be 0).

Starts real daemons (tests/support/daemon_proc.py: fake GPU and MPS, everything else real, cgroup
v2 where the machine has it) under /tmp and injects, for real: kill -9 of the daemon at each step
of a client restart (bench/support/crash_points.py), a lock held by another process at start and
while running, a full disk (a small tmpfs filled to the last byte) at start and while running, a
read-only state directory at start, and a damaged database (moved aside, ids must not come back).
After each it counts the clients lost or failed, the good databases renamed, and the client ids
given again. Prints a table and writes bench/results/registry_faults.json. Needs root.

    .venv/bin/python bench/registry_faults.py [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sqlite3
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.crash_points import STEPS
from bench.support.daemon_helpers import REPO, DaemonProc, wait_for
from bench.support.faults import fill, free, remount, small_tmpfs, sqlite_locked

OUT = REPO / "bench" / "results" / "registry_faults.json"
CHECKPOINTING = 'trap "exit 0" USR1; while :; do sleep 0.2 & wait $!; done'
BAD = {"lost", "failed"}


class Tally:
    """What one kind of fault did: injected, clients lost, databases renamed, ids reused."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, int]] = {}

    def add(self, fault: str, *, lost: int = 0, renamed: int = 0, reused: int = 0) -> None:
        row = self.rows.setdefault(fault, {"injected": 0, "lost": 0, "renamed": 0, "reused": 0})
        row["injected"] += 1
        row["lost"] += lost
        row["renamed"] += renamed
        row["reused"] += reused


def _lost(dp: DaemonProc) -> int:
    return sum(c["state"] in BAD for c in dp.call("list", {"all": True})["clients"])


def _renamed(dp: DaemonProc) -> int:
    return sum(".corrupt-" in p.name for p in dp.db.parent.iterdir())


def _running(dp: DaemonProc, cid: str, not_pid: int | None = None) -> bool:
    """Whether the client runs (a client the registry no longer knows is lost too)."""
    try:
        c = dp.client(cid)
    except KeyError:
        return False
    return c["state"] == "running" and c["pid"] not in (None, not_pid)


def kill9_at(step: str, tally: Tally) -> None:
    dp = DaemonProc(gpus=1, env={"GPUSHARE_TEST_RESTART_ONCE": "1", "GPUSHARE_TEST_CRASH_AT": step})
    try:
        dp.start()
        sub = dp.submit_detached(["sh", "-c", CHECKPOINTING, f"gs-bench-{uuid.uuid4().hex[:6]}"],
                                 restartable=True)  # fmt: skip
        assert dp.proc is not None
        wait_for(lambda: dp.proc.poll() is not None, 30.0, f"the kill at {step}")
        dp.env = {}
        dp.start()
        with contextlib.suppress(AssertionError):
            wait_for(lambda: _running(dp, sub["client_id"], sub["pid"]), 30.0, "the relaunch")
        lost = _lost(dp) + (not _running(dp, sub["client_id"], sub["pid"]))
        tally.add(f"kill -9 at restart step '{step}'", lost=lost, renamed=_renamed(dp))
    finally:
        dp.cleanup()


def _with_client(body: Callable[[DaemonProc, str], None], *, tmpfs: bool = False) -> None:
    dp = DaemonProc(gpus=1)
    # Client logs elsewhere: a workload holding its log open would keep the tmpfs from going ro.
    logs = f'[paths]\nclient_log_dir = "{dp.base}/logs"\n'
    dp.config_path.write_text(dp.config_text().replace("[paths]\n", logs))
    try:
        mount = small_tmpfs(dp.base / "state", "4m") if tmpfs else contextlib.nullcontext()
        with mount:
            dp.start()
            cid = dp.submit_detached(["sleep", "600"])["client_id"]
            body(dp, cid)
            dp.cleanup()
    finally:
        dp.cleanup()


def _restart_expecting(dp: DaemonProc) -> bool:
    """Start again after a fault at start; whether the daemon came up (a one-line refusal: no)."""
    try:
        dp.start()
    except AssertionError:
        return False
    return True


def faults_at_start(tally: Tally) -> None:
    def locked(dp: DaemonProc, cid: str) -> None:
        dp.kill9()
        with sqlite_locked(dp.db):
            _restart_expecting(dp)  # waits out the busy timeout, then one line
        dp.start()
        tally.add("locked database at start", lost=_lost(dp) + (not _running(dp, cid)),
                  renamed=_renamed(dp))  # fmt: skip

    def full(dp: DaemonProc, cid: str) -> None:
        dp.kill9()
        fill(dp.db.parent)
        if _restart_expecting(dp):
            dp.kill9()
        free(dp.db.parent)
        dp.start()
        tally.add("disk full at start", lost=_lost(dp) + (not _running(dp, cid)),
                  renamed=_renamed(dp))  # fmt: skip

    def read_only(dp: DaemonProc, cid: str) -> None:
        dp.kill9()
        remount(dp.db.parent, "ro")
        try:
            if _restart_expecting(dp):
                dp.kill9()
        finally:
            remount(dp.db.parent, "rw")
        dp.start()
        tally.add("read-only state directory at start", lost=_lost(dp) + (not _running(dp, cid)),
                  renamed=_renamed(dp))  # fmt: skip

    _with_client(locked)
    _with_client(full, tmpfs=True)
    _with_client(read_only, tmpfs=True)


def faults_while_running(tally: Tally) -> None:
    def writes(dp: DaemonProc, cid: str) -> None:
        for _ in range(5):  # each pause and resume is a registry write
            dp.call("pause", {"client_id": cid})
            dp.call("resume", {"client_id": cid})

    def locked(dp: DaemonProc, cid: str) -> None:
        with sqlite_locked(dp.db):
            writes(dp, cid)
        time.sleep(1.5)  # the backlog is retried once a second
        dp.call("status")
        ok = dp.client(cid)["state"] == "running" and _from_file(dp, cid) == "running"
        tally.add("lock held while running", lost=_lost(dp) + (not ok), renamed=_renamed(dp))

    def full(dp: DaemonProc, cid: str) -> None:
        fill(dp.db.parent)
        writes(dp, cid)
        dp.call("pause", {"client_id": cid})
        free(dp.db.parent)
        time.sleep(1.5)
        dp.call("status")
        dp.kill9()
        dp.start()
        ok = dp.client(cid)["state"] == "frozen"
        tally.add("disk full while running", lost=_lost(dp) + (not ok), renamed=_renamed(dp))

    _with_client(locked)
    _with_client(full, tmpfs=True)


def _from_file(dp: DaemonProc, cid: str) -> str:
    with contextlib.closing(sqlite3.connect(dp.db)) as conn:
        return str(conn.execute("SELECT state FROM clients WHERE id = ?", (cid,)).fetchone()[0])


def damaged_database(tally: Tally) -> None:
    dp = DaemonProc(gpus=1)
    try:
        dp.start()
        old = {dp.submit_detached(["true"])["client_id"] for _ in range(3)}
        dp.kill9()
        for side in ("-wal", "-shm"):
            Path(f"{dp.db}{side}").unlink(missing_ok=True)
        dp.db.write_bytes(b"not a database " * 100)
        dp.start()
        new = {dp.submit_detached(["true"])["client_id"] for _ in range(3)}
        tally.add("damaged database (moved aside)", reused=len(old & new))
    finally:
        dp.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="times each fault is injected")
    args = parser.parse_args()
    tally = Tally()
    t0 = time.monotonic()
    for _ in range(args.rounds):
        for step in STEPS:
            kill9_at(step, tally)
        faults_at_start(tally)
        faults_while_running(tally)
        damaged_database(tally)
    total = {
        k: sum(r[k] for r in tally.rows.values()) for k in ("injected", "lost", "renamed", "reused")
    }
    print(f"{'fault':<40} {'injected':>8} {'lost':>5} {'renamed':>8} {'ids reused':>10}")
    for fault, r in tally.rows.items():
        print(f"{fault:<40} {r['injected']:>8} {r['lost']:>5} {r['renamed']:>8} {r['reused']:>10}")
    print(f"{'total':<40} {total['injected']:>8} {total['lost']:>5} {total['renamed']:>8} "
          f"{total['reused']:>10}   ({time.monotonic() - t0:.0f} s)")  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "faults_injected": total["injected"], "clients_lost": total["lost"],
        "good_databases_renamed": total["renamed"], "client_ids_reused": total["reused"],
        "by_fault": tally.rows, "rounds": args.rounds,
    }  # fmt: skip
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if total["lost"] == total["renamed"] == total["reused"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
