"""A real daemon under faults (issue 27): kill -9 at every step of a restart, a full disk during a
burst, a registry reset between two users, a client lost while the daemon was down.

Real daemon processes (tests/support/daemon_proc.py: fake GPU and MPS, everything else real), real
cgroup v2, a real tmpfs filled to the last byte, a second real user (``nobody``). The figure each
test checks is the one bench/abuse.py reports: clients lost, which must be 0.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason
from bench.support.crash_points import STEPS
from bench.support.daemon_helpers import (
    REPO,
    DaemonProc,
    call_as,
    duty_gpu_daemon,
    python_for_others,
    wait_for,
)
from bench.support.faults import fill, free, small_tmpfs, tmpfs_skip_reason
from gpushare.node.procs.identity import is_same_process, process_start_time

# Exits cleanly on its checkpoint signal (SIGUSR1), as a restartable job should; $0 marks it.
CHECKPOINTING = 'trap "exit 0" USR1; while :; do sleep 0.2 & wait $!; done'
LOST_STATES = {"lost", "failed"}


def _needs_cgroups() -> None:
    if (reason := cgroup_skip_reason()) is not None:
        pytest.skip(reason)


def _nobody() -> tuple[int, int]:
    pw = pwd.getpwnam("nobody")
    if python_for_others() is None:
        pytest.skip("no Python interpreter that nobody may execute")
    return pw.pw_uid, pw.pw_gid


def _marked(marker: str) -> list[int]:
    """Pids of the live processes whose command line carries ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return sorted(found)


def _alive(pid: int) -> bool:
    start = process_start_time(pid)
    return start is not None and is_same_process(pid, start)


def _lost(dp: DaemonProc) -> list[dict[str, Any]]:
    return [c for c in dp.call("list", {"all": True})["clients"] if c["state"] in LOST_STATES]


@pytest.fixture
def dp_factory() -> Iterator[Any]:
    made: list[DaemonProc] = []

    def make(**kw: Any) -> DaemonProc:
        d = DaemonProc(**kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.cleanup()


# ----------------------------------------------------------------------------- kill -9 and restarts


@pytest.mark.parametrize("step", STEPS)
def test_a_restart_survives_kill_9_of_the_daemon_at_every_step(dp_factory: Any, step: str) -> None:
    _needs_cgroups()
    dp = dp_factory(gpus=1, env={"GPUSHARE_TEST_RESTART_ONCE": "1", "GPUSHARE_TEST_CRASH_AT": step})
    marker = f"gs-restart-{uuid.uuid4().hex[:8]}"
    dp.start()
    sub = dp.submit_detached(["sh", "-c", CHECKPOINTING, marker], restartable=True)
    cid, first = sub["client_id"], sub["pid"]
    assert dp.proc is not None
    wait_for(lambda: dp.proc.poll() is not None, 20.0, f"the daemon to be killed at {step}")
    assert dp.proc.returncode == -signal.SIGKILL
    dp.env = {}
    dp.start()

    def relaunched() -> dict[str, Any] | None:
        c = dp.client(cid)
        ok = c["state"] == "running" and c["pid"] not in (None, first) and _alive(c["pid"])
        return c if ok else None

    c = wait_for(relaunched, 30.0, f"{cid} to run again after a kill -9 at {step}")
    # One launch runs, no leftover of the interrupted one, nothing lost or failed.
    wait_for(
        lambda: _marked(marker) == [c["pid"]], 10.0, f"only {c['pid']} to run ({_marked(marker)})"
    )
    assert _lost(dp) == []


def test_a_client_lost_while_the_daemon_was_down_leaves_nothing_running(dp_factory: Any) -> None:
    _needs_cgroups()
    dp = dp_factory(gpus=1)
    dp.start()
    marker = f"gs-lost-{uuid.uuid4().hex[:8]}"
    # The children carry the marker too: exec -a names them.
    job = f"(exec -a {marker}-child sleep 300) & (exec -a {marker}-child sleep 300) & wait"
    cid = dp.submit_detached(["bash", "-c", job, marker])["client_id"]
    main = dp.client(cid)["pid"]
    wait_for(lambda: len(_marked(marker)) == 3, 10.0, "the job and its two children")
    dp.kill9()
    os.kill(main, signal.SIGKILL)  # its main process ends while the daemon is down
    wait_for(lambda: len(_marked(marker)) == 2, 10.0, "the children to outlive it")
    dp.start()
    c = wait_for(lambda: (c := dp.client(cid))["state"] == "lost" and c, 15.0, "lost")
    assert "2 leftover processes of its cgroup killed" in c["reason"]
    wait_for(lambda: _marked(marker) == [], 10.0, "the leftovers to be gone")
    assert dp.cgroup_dir is not None and not (dp.cgroup_dir / f"client-{cid}").exists()


# ----------------------------------------------------------------------------- identities


def _submit_as(
    dp: DaemonProc, uid: int, gid: int, argv: list[str], gpu: str = "0"
) -> dict[str, Any]:
    params = {"cls": "offline", "argv": argv, "detach": True, "cwd": "/", "gpu": gpu,
              "env": {"PATH": "/usr/bin:/bin"}}  # fmt: skip
    return call_as(uid, gid, dp.socket, "submit", params)


def _frozen(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _reset_registry(dp: DaemonProc, *, forget_everything: bool) -> None:
    """What a damaged database leads to (the daemon moves it aside); or a state dir wiped too."""
    dp.kill9()
    for side in ("", "-wal", "-shm"):
        Path(f"{dp.db}{side}").unlink(missing_ok=True)
    dp.db.write_bytes(b"not a database " * 100)
    if forget_everything:
        (dp.db.parent / "client-ids").unlink(missing_ok=True)
        for log in (dp.db.parent / "clients").iterdir():
            log.unlink()


def test_a_new_client_after_a_registry_reset_gets_nothing_of_an_old_one(dp_factory: Any) -> None:
    _needs_cgroups()
    uid, gid = _nobody()
    dp = dp_factory(gpus=1)
    dp.start()
    old = dp.submit_detached(["sh", "-c", "echo root-secret-output; exec sleep 300"])
    old_log = Path(old["log_path"])
    wait_for(lambda: "root-secret-output" in old_log.read_text(), 5.0, "root's output")
    _reset_registry(dp, forget_everything=False)
    dp.start()
    assert any(e["kind"] == "registry_corrupt" for e in dp.events())
    new = _submit_as(dp, uid, gid, ["sleep", "300"])["result"]
    assert new["client_id"] != old["client_id"] and new["log_path"] != old["log_path"]
    assert call_as(uid, gid, dp.socket, "pause", {"client_id": new["client_id"]}).get("result")
    time.sleep(0.3)
    assert not _frozen(old["pid"]), "the new user's pause froze the old client's process"
    st = old_log.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600)
    assert "root-secret-output" in old_log.read_text()


def test_with_the_id_mark_and_logs_gone_too_an_old_cgroup_is_still_never_joined(
    dp_factory: Any,
) -> None:
    _needs_cgroups()
    uid, gid = _nobody()
    dp = dp_factory(gpus=1)
    dp.start()
    old = dp.submit_detached(["sleep", "300"])
    _reset_registry(dp, forget_everything=True)
    dp.start()
    out = _submit_as(dp, uid, gid, ["sleep", "300"])
    # The id comes round again (nothing on the host remembers it): the launch is refused.
    assert "error" in out and "already holds processes" in out["message"], out
    assert dp.cgroup_dir is not None
    procs = (dp.cgroup_dir / f"client-{old['client_id']}" / "cgroup.procs").read_text().split()
    assert procs == [str(old["pid"])] and not _frozen(old["pid"])


# ----------------------------------------------------------------------------- secrets


def test_another_user_finds_no_submitted_secret_in_the_state_directory(dp_factory: Any) -> None:
    uid, gid = _nobody()
    dp = dp_factory(gpus=2)  # one user per GPU's MPS here (D11)
    dp.start()
    secret = f"hunter2-{uuid.uuid4().hex}"
    dp.submit_detached(
        ["sleep", "300"], gpu="0", env={"PATH": os.environ["PATH"], "ROOT_DB_PASSWORD": secret}
    )
    out = _submit_as(dp, uid, gid, ["sh", "-c", "echo mine; exec sleep 300"], gpu="1")
    theirs = out.get("result") or pytest.fail(str(out))
    state = dp.db.parent
    out = subprocess.run(["grep", "-rl", secret, str(state)], user=uid, group=gid,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and out.stdout == "", out
    wal = Path(f"{dp.db}-wal")
    assert wal.exists() and secret.encode() in wal.read_bytes() + dp.db.read_bytes()
    for path in (dp.db, wal, Path(f"{dp.db}-shm")):
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert state.stat().st_mode & 0o777 == 0o711
    assert (state / "clients").stat().st_mode & 0o777 == 0o711
    # Their own log they can read by the path submit printed, and nobody else's.
    log = Path(theirs["log_path"])
    assert (log.stat().st_uid, log.stat().st_mode & 0o777) == (uid, 0o600)
    wait_for(lambda: "mine" in log.read_text(), 5.0, "their output")
    mine = subprocess.run(["cat", str(log)], user=uid, group=gid, capture_output=True, text=True)
    assert mine.stdout == "mine\n"


# ----------------------------------------------------------------------------- full disk


def _cli_online(dp: DaemonProc) -> subprocess.Popen[bytes]:
    code = "import time\nwhile True: time.sleep(0.005)"
    return subprocess.Popen(
        [sys.executable, "-m", "gpushare", "submit", "--socket", str(dp.socket), "--online",
         "--slo-p99", "40ms", "--gpu", "0", "--", sys.executable, "-c", code],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def test_a_disk_filling_during_a_burst_loses_no_client_and_no_event(tmp_path: Path) -> None:
    _needs_cgroups()
    if (reason := tmpfs_skip_reason()) is not None:
        pytest.skip(reason)
    dp, gpu_dir = duty_gpu_daemon('[control]\nperiod = "50ms"\n', "cgroup")
    online = None
    try:
        with small_tmpfs(dp.base / "state", "4m") as state:
            dp.start()
            online = _cli_online(dp)
            wait_for(lambda: any(c["class"] == "online" and c["state"] == "running"
                                 for c in dp.call("list")["clients"]), 15.0, "online")  # fmt: skip
            offline = dp.submit_detached([sys.executable, "-c", "while True: pass"], gpu="0",
                                         restartable=True)["client_id"]  # fmt: skip
            wait_for(lambda: dp.call("status")["gpus"][0]["duty"] == 1.0, 10.0, "duty 1")
            fill(state)
            (gpu_dir / "burst").touch()
            wait_for(lambda: dp.call("status")["gpus"][0]["duty"] <= 0.05, 10.0, "the duty cut")
            assert dp.client(offline)["state"] == "throttled"
            refused = call_as(0, 0, dp.socket, "submit", {"cls": "offline", "argv": ["true"],
                              "detach": True, "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}})  # fmt: skip
            assert "full" in refused.get("message", ""), refused
            free(state)
            kinds = wait_for(lambda: "registry_write_resumed" in (k := [e["kind"] for e in dp.events()])
                             and k, 10.0, "the backlog to be written")  # fmt: skip
            # What happened while the disk was full is in the file, before the resumption.
            resumed = kinds.index("registry_write_resumed")
            assert "offline_throttled" in kinds[:resumed] and "client_throttled" in kinds[:resumed]
            (gpu_dir / "burst").unlink()
            dp.kill9()  # what was kept in memory is now in the file: a restart sees it
            dp.start()
            assert dp.client(offline)["state"] in ("running", "throttled") and _lost(dp) == []
            dp.cleanup()
    finally:
        if online is not None:
            online.kill()
            online.wait(timeout=10)
        dp.cleanup()


def _settled(dp: DaemonProc, cid: str) -> dict[str, Any]:
    """The client once the controller has stopped restarting it (it follows the offline share)."""
    seen: list[tuple[Any, ...]] = []

    def still() -> dict[str, Any] | None:
        c = dp.client(cid)
        seen.append((c["state"], c["pid"], c["restarts"]))
        return (
            c if len(seen) > 15 and len(set(seen[-15:])) == 1 and c["state"] == "running" else None
        )

    return wait_for(still, 20.0, f"{cid} to settle")


def test_a_restart_while_the_disk_is_full_is_carried_through_and_kept(dp_factory: Any) -> None:
    # Issue 27: a restartable job caught mid-restart by a full disk stayed RESTARTING, no process.
    _needs_cgroups()
    if (reason := tmpfs_skip_reason()) is not None:
        pytest.skip(reason)
    flag = Path(f"/tmp/gs-restart-now-{uuid.uuid4().hex[:8]}")
    dp = dp_factory(gpus=1, env={"GPUSHARE_TEST_RESTART_ONCE": str(flag)})
    marker = f"gs-full-{uuid.uuid4().hex[:8]}"
    try:
        with small_tmpfs(dp.base / "state", "4m") as state:
            dp.start()
            cid = dp.submit_detached(["sh", "-c", CHECKPOINTING, marker], restartable=True)[
                "client_id"
            ]
            before = _settled(dp, cid)
            fill(state)
            flag.touch()

            def relaunched() -> dict[str, Any] | None:
                c = dp.client(cid)
                ok = c["state"] == "running" and c["pid"] not in (None, before["pid"])
                return c if ok else None

            c = wait_for(relaunched, 15.0, "the restart to be carried through on a full disk")
            assert c["restarts"] == before["restarts"] + 1
            # The new process may still be between fork and exec (its command line is the
            # daemon's until then), so wait for the marker rather than read it once.
            wait_for(
                lambda: _marked(marker) == [c["pid"]],
                10.0,
                f"only {c['pid']} to run ({_marked(marker)})",
            )
            free(state)
            wait_for(lambda: "registry_write_resumed" in [e["kind"] for e in dp.events()], 10.0,
                     "the backlog to be written")  # fmt: skip
            dp.kill9()
            dp.env = {}
            dp.start()
            after = dp.client(cid)
            assert (after["state"], after["pid"], after["restarts"]) == (
                "running", c["pid"], c["restarts"]
            )  # fmt: skip
            assert _lost(dp) == []
            dp.cleanup()
    finally:
        flag.unlink(missing_ok=True)


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_state_directory_that_cannot_be_written_stops_the_start_in_one_line(
    dp_factory: Any, fault: str
) -> None:
    if (reason := tmpfs_skip_reason()) is not None:
        pytest.skip(reason)
    dp = dp_factory(gpus=1)
    with small_tmpfs(dp.base / "state", "1m") as state:
        if fault == "full":
            fill(state)
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(state)], check=True)
        with pytest.raises(AssertionError, match="daemon exited 1"):
            dp.start()
        err = dp.stderr_path.read_text().strip().splitlines()
        assert len(err) == 1 and err[0].startswith("gpushare: ") and "Traceback" not in err[0]
        assert ("full" if fault == "full" else "read-only") in err[0].lower()
        assert not any(".corrupt-" in p.name for p in state.iterdir())
        assert not dp.db.exists()
