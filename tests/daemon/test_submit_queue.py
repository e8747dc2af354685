"""The queue for offline submits, end to end: a real daemon (fake GPU), the real CLI.

One 16G GPU with 1G used and the 2G online reserve: three offline jobs of ``--mem 4G`` fit (their
memory is promised until NVML shows it), a fourth waits. On b0c0ecb the fourth was refused
(exit 1, "needs 6G ... free") and nothing waited.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from bench.support.accounts import Account
from bench.support.daemon_helpers import REPO, DaemonProc, call_as, wait_for


@pytest.fixture
def one_gpu() -> Iterator[DaemonProc]:
    d = DaemonProc(gpus=1)
    try:
        yield d.start()
    finally:
        d.cleanup()


def _cli(d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpushare", *args], cwd=REPO, capture_output=True, text=True,
        env={**os.environ, "GPUSHARE_SOCKET": str(d.socket), "NO_COLOR": "1"}, timeout=30,
        check=False,
    )  # fmt: skip


def _offline(d: DaemonProc, *extra: str) -> subprocess.CompletedProcess[str]:
    return _cli(d, "submit", "--offline", "--detach", "--mem", "4G", *extra, "--", "sleep", "60")


def _clients(d: DaemonProc) -> dict[str, dict[str, object]]:
    return {c["id"]: c for c in d.call("list", {"all": True})["clients"]}


def _fill(d: DaemonProc) -> list[str]:
    ids = []
    for _ in range(3):
        r = _offline(d)
        assert r.returncode == 0, r.stderr
        ids.append(r.stdout.split()[0])
    return ids


def test_offline_submits_wait_in_order_and_start_when_a_gpu_frees(one_gpu: DaemonProc) -> None:
    d = one_gpu
    running = _fill(d)
    late = _offline(d)
    assert late.returncode == 0, late.stderr
    assert late.stdout.startswith("c4 queued (position 1): GPU 0: needs 6G"), late.stdout
    short = _offline(d, "--time", "10m")  # declared shorter: tried first
    assert short.stdout.startswith("c5 queued (position 1)"), short.stdout
    where = {c: v["queue_position"] for c, v in _clients(d).items() if v["state"] == "queued"}
    assert where == {"c5": 1, "c4": 2}
    # Refusals leave no record: the next id follows on.
    refused = _offline(d, "--no-queue")
    assert refused.returncode == 5, refused.stderr
    online = _cli(d, "submit", "--online", "--detach", "--mem", "12G", "--", "sleep", "60")
    assert online.returncode == 5 and "needs 12G" in online.stderr, online.stderr
    assert sorted(_clients(d)) == ["c1", "c2", "c3", "c4", "c5"]
    # status and list show the queue.
    status = json.loads(_cli(d, "status", "--json").stdout)
    assert {c["id"]: c["state"] for c in status["clients"]}["c4"] == "queued"
    assert "queued" in _cli(d, "list").stdout
    # One running job ends: the shortest declared job starts, the other keeps waiting.
    assert _cli(d, "cancel", running[0]).returncode == 0
    wait_for(lambda: _clients(d)["c5"]["state"] == "running", 15.0, "c5 to start")
    assert _clients(d)["c4"]["state"] == "queued"


def test_the_queue_survives_a_daemon_restart(one_gpu: DaemonProc) -> None:
    d = one_gpu
    running = _fill(d)
    assert _offline(d).stdout.startswith("c4 queued")
    d.stop()
    d.start()
    assert _clients(d)["c4"]["state"] == "queued"
    for cid in running:
        _cli(d, "cancel", cid)
    wait_for(lambda: _clients(d)["c4"]["state"] == "running", 20.0, "c4 to start after restart")


def test_a_job_that_can_never_fit_is_refused_not_queued(one_gpu: DaemonProc) -> None:
    r = _cli(one_gpu, "submit", "--offline", "--detach", "--mem", "15G", "--", "sleep", "1")
    assert r.returncode == 5
    assert "needs 17G with 2G kept for online clients" in r.stderr
    assert _clients(one_gpu) == {}


def test_a_foreground_submit_waits_with_a_progress_line_then_runs_in_place(
    one_gpu: DaemonProc,
) -> None:
    d = one_gpu
    running = _fill(d)
    script = "import os; print('ran', os.environ['GPUSHARE_CLIENT_ID'], os.getpid(), flush=True)"
    fg = subprocess.Popen(
        [sys.executable, "-m", "gpushare", "submit", "--offline", "--mem", "4G", "--",
         sys.executable, "-c", script],
        cwd=REPO, env={**os.environ, "GPUSHARE_SOCKET": str(d.socket)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: "c4" in _clients(d), 15.0, "the foreground submit to queue")
        time.sleep(2.5)  # it keeps asking, and keeps its place
        assert _clients(d)["c4"]["state"] == "queued"
        assert fg.poll() is None
        _cli(d, "cancel", running[0])
        out, err = fg.communicate(timeout=30)
    finally:
        if fg.poll() is None:
            fg.send_signal(signal.SIGKILL)
    assert fg.returncode == 0, err
    assert err.splitlines()[0].startswith("c4 queued (position 1): GPU 0: needs 6G"), err
    assert "c4: started on" in err
    word, cid, pid = out.split()
    assert (word, cid) == ("ran", "c4")
    # The submitting process itself became the workload (adopted in place, then exec).
    assert _clients(d)["c4"]["pid"] == int(pid) == fg.pid


def test_list_filters_by_state_class_user_and_gpu(one_gpu: DaemonProc) -> None:
    d = one_gpu
    _fill(d)
    assert _offline(d).stdout.startswith("c4 queued")
    assert _offline(d).stdout.startswith("c5 queued")

    def ids(*args: str) -> list[str]:
        r = _cli(d, "list", "--json", *args)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["schema_version"] == 1
        return sorted(c["id"] for c in doc["clients"])

    assert ids("--state", "queued") == ["c4", "c5"]
    assert ids("--state", "running,queued", "--class", "offline") == ["c1", "c2", "c3", "c4", "c5"]
    assert ids("--class", "online") == []
    assert ids("--user", "root", "--gpu", "0", "--state", "running") == ["c1", "c2", "c3"]
    assert ids("--user", "nobody") == []
    bad = _cli(d, "list", "--state", "sleeping")
    assert bad.returncode == 2 and "unknown sleeping" in bad.stderr
    table = _cli(d, "list", "--state", "queued").stdout.splitlines()
    assert table[0].split()[-3:] == ["EXIT", "AGE", "REASON"]


def test_one_user_may_queue_only_so_many_jobs(accounts: tuple[Account, Account, Account]) -> None:
    # docs/security.md §4: a queued job is a record the daemon keeps; without a per-uid limit one
    # user's submits (a loop, or 10^6 fuzzed frames) grow the daemon without bound.
    a, b, _ = accounts
    d = DaemonProc(gpus=1, daemon_toml="max_queued_per_uid = 2").start()
    try:
        _fill(d)  # root's three jobs hold the GPU: every further job queues
        job = {"cls": "offline", "argv": ["sleep", "60"], "detach": True, "cwd": "/",
               "env": {"PATH": os.environ["PATH"]}, "mem_bytes": 4 << 30}  # fmt: skip
        for _ in range(2):
            assert call_as(a.uid, a.gid, d.socket, "submit", job)["result"]["state"] == "queued"
        refused = call_as(a.uid, a.gid, d.socket, "submit", job)
        assert refused["error"] == "NO_CAPACITY", refused
        assert "max_queued_per_uid = 2" in refused["message"]
        # another user, and root, are not held back by it
        assert call_as(b.uid, b.gid, d.socket, "submit", job)["result"]["state"] == "queued"
        assert _offline(d).returncode == 0 and _offline(d).returncode == 0
        assert _offline(d).returncode == 0  # root: no limit
        queued = [c for c in _clients(d).values() if c["state"] == "queued"]
        assert sorted(str(c["user"]) for c in queued).count(a.name) == 2
    finally:
        d.cleanup()
