"""The daemon end to end: pause, resume and cancel of a client, and who may do them (its owner and
the admin group; any user may read).

A real daemon process, real socket, SQLite, signals and workloads; only the GPU
(tests/fakes/fake_gpu.py) and the MPS side (tests/fakes/fake_mps.py) are fakes.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from bench.support.cgroup_helpers import cgroup_skip_reason
from bench.support.daemon_helpers import DaemonProc, call_as, cpu_ticks, wait_for
from tests.support.daemon_e2e import NOBODY, _state, needs_root


def test_pause_and_resume_stop_and_restart_cpu(daemon: DaemonProc) -> None:
    res = daemon.submit_detached([sys.executable, "-c", "while True: pass"])
    cid, pid = res["client_id"], res["pid"]
    wait_for(lambda: cpu_ticks(pid) > 5, what="busy child to burn CPU")
    assert daemon.call("pause", {"client_id": cid})["state"] == "frozen"
    import time

    time.sleep(0.1)
    t0 = cpu_ticks(pid)
    time.sleep(0.6)
    assert cpu_ticks(pid) - t0 <= 1, "a paused client kept running"
    c = daemon.client(cid)
    assert c["held"] is True
    # The real cgroup v2 freezer where the machine has one, else the signal fallback.
    assert c["pause_mechanism"] == ("cgroup" if cgroup_skip_reason() is None else "signal")
    assert daemon.call("resume", {"client_id": cid})["state"] == "running"
    t1 = cpu_ticks(pid)
    time.sleep(0.6)
    assert cpu_ticks(pid) - t1 >= 10, "a resumed client did not run"
    out = daemon.call("cancel", {"client_id": cid})
    assert out["grace_s"] == 2.0
    wait_for(lambda: _state(daemon, cid) == "exited", what="cancel")
    assert daemon.client(cid)["exit_code"] == -signal.SIGTERM


def test_cancel_escalates_to_kill_after_grace(daemon: DaemonProc) -> None:
    res = daemon.submit_detached(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
        ]
    )
    cid = res["client_id"]
    import time

    time.sleep(0.3)  # let it install its handler
    daemon.call("cancel", {"client_id": cid})
    wait_for(lambda: _state(daemon, cid) == "exited", timeout_s=6.0, what="SIGKILL after grace")
    c = daemon.client(cid)
    assert c["exit_code"] == -signal.SIGKILL
    assert c["reason"] == "cancelled by root"


@needs_root
def test_rights_other_uid_cannot_touch_but_can_read(daemon: DaemonProc) -> None:
    res = daemon.submit_detached(["sleep", "30"])
    cid = res["client_id"]
    for method in ("cancel", "pause", "resume"):
        out = call_as(NOBODY, NOBODY, daemon.socket, method, {"client_id": cid})
        assert out["error"] == "PERMISSION_DENIED", out
        assert "only its owner or root may" in out["message"]  # no "group ''" without a group
        assert "group" not in out["message"]
    assert _state(daemon, cid) == "running"
    seen = call_as(NOBODY, NOBODY, daemon.socket, "status", {})
    assert cid in [c["id"] for c in seen["result"]["clients"]]
    # nobody's own detached client runs as nobody, and nobody may cancel it
    mine = call_as(NOBODY, NOBODY, daemon.socket, "submit",
                   {"cls": "offline", "argv": ["sleep", "30"], "detach": True, "cwd": "/",
                    "env": {"PATH": os.environ["PATH"]}})["result"]  # fmt: skip
    status = Path(f"/proc/{mine['pid']}/status").read_text()
    uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    assert uid_line.split()[1:] == [str(NOBODY)] * 4
    assert call_as(NOBODY, NOBODY, daemon.socket, "cancel", {"client_id": mine["client_id"]})[
        "result"
    ]
    daemon.call("cancel", {"client_id": cid})
    wait_for(lambda: _state(daemon, cid) == "exited", what="root cancels")


@needs_root
def test_admin_group_member_may_pause_others() -> None:
    d = DaemonProc(
        '[daemon]\nadmin_group = "nogroup"\ncancel_grace = "2s"'.replace("[daemon]\n", "", 0)
    )
    # The helper's [daemon] table already exists: rewrite it with the admin group.
    d.config_path.write_text(d.config_text().replace('admin_group = ""', 'admin_group = "nogroup"'))
    try:
        d.start()
        cid = d.submit_detached(["sleep", "30"])["client_id"]
        out = call_as(NOBODY, NOBODY, d.socket, "pause", {"client_id": cid})
        assert out["result"]["state"] == "frozen"
        assert (
            call_as(NOBODY, NOBODY, d.socket, "resume", {"client_id": cid})["result"]["state"]
            == "running"
        )
    finally:
        d.cleanup()
