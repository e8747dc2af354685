"""The daemon end to end: a real daemon process, real socket, SQLite, signals and workloads.

Only the GPU (tests/fakes/fake_gpu.py) and the MPS side (tests/fakes/fake_mps.py) are fakes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason
from bench.support.daemon_helpers import (
    REPO,
    DaemonProc,
    call_as,
    cpu_ticks,
    python_for_others,
    wait_for,
)
from gpushare.client import ApiClient, ApiError
from gpushare.protocol import ErrorCode
from tests.fakes.fake_gpu import fake_uuid

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or python_for_others() is None,
    reason="needs root (to switch uid) and a Python interpreter other uids may execute",
)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc().start()
    yield d
    d.cleanup()


def _state(d: DaemonProc, cid: str) -> str:
    return str(d.client(cid)["state"])


def run_cli(d: DaemonProc, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpushare", *args],
        cwd=REPO,
        env={**os.environ, "GPUSHARE_SOCKET": str(d.socket)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


ENV_DUMP = (
    "import json, os, sys; "
    "print(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith(('CUDA', 'GPUSHARE')) and k != 'GPUSHARE_SOCKET'})); "
    "sys.exit(int(sys.argv[1]))"
)


def test_foreground_submit_sees_mps_env_and_keeps_exit_code(daemon: DaemonProc) -> None:
    r = run_cli(
        daemon, "submit", "--offline", "--gpu", "1", "--sm", "30", "--mem", "2G", "--name", "fg",
        "--", sys.executable, "-c", ENV_DUMP, "7",
    )  # fmt: skip
    assert r.returncode == 7, r.stderr
    env = json.loads(r.stdout)
    uuid = fake_uuid(1)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == f"{daemon.base}/run/mps/{uuid}"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{uuid}=2G"
    assert env["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert env["GPUSHARE_GPU_UUID"] == uuid
    assert env["GPUSHARE_LATENCY_SOCKET"] == f"{daemon.base}/run/latency.sock"
    cid = env["GPUSHARE_CLIENT_ID"]
    # The daemon adopted the CLI's pid (which became the workload) and noticed its exit.
    wait_for(lambda: _state(daemon, cid) in ("exited", "failed"), what="foreground exit recorded")
    c = daemon.client(cid)
    # The daemon is not the workload's parent: it sees the exit status only when it reads the
    # zombie before the shell reaps it; otherwise the status is unknown, never invented.
    assert (c["state"], c["exit_code"]) in (("exited", None), ("failed", 7))
    assert (c["name"], c["class"], c["gpu_index"], c["sm_pct"]) == ("fg", "offline", 1, 30.0)


def test_online_priority_and_defaults(daemon: DaemonProc) -> None:
    r = run_cli(
        daemon, "submit", "--online", "--slo-p99", "40ms", "--", sys.executable, "-c", ENV_DUMP, "0"
    )
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)
    assert env["CUDA_MPS_CLIENT_PRIORITY"] == "0"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
    assert daemon.client(env["GPUSHARE_CLIENT_ID"])["slo_p99_ms"] == pytest.approx(40.0)


def test_offline_clients_launch_at_the_configured_priority() -> None:
    """``[control] offline_mps_priority = 0``: offline clients get the online clients' priority."""
    d = DaemonProc("[control]\noffline_mps_priority = 0\n").start()
    try:
        r = run_cli(d, "submit", "--offline", "--", sys.executable, "-c", ENV_DUMP, "0")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["CUDA_MPS_CLIENT_PRIORITY"] == "0"
    finally:
        d.cleanup()


def test_detached_submit_runs_with_env_and_records_exit_code(
    daemon: DaemonProc, tmp_path: Path
) -> None:
    share = daemon.call("status")["gpus"][0]["offline_sm_pct"]
    expected = f"{share:g}"
    res = daemon.submit_detached(
        ["sh", "-c", 'echo "sm=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE cvd=${CUDA_VISIBLE_DEVICES-unset} '
         'mine=$MINE"; exit 3'],
        env={"PATH": os.environ["PATH"], "MINE": "kept", "CUDA_VISIBLE_DEVICES": "5"},
        cwd=str(tmp_path),
        gpu="0",
    )  # fmt: skip
    cid = res["client_id"]
    # Without --sm an offline client gets the GPU's current offline share (the controller's).
    assert res["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == expected
    wait_for(lambda: _state(daemon, cid) == "failed", what="detached exit")
    c = daemon.client(cid)
    assert c["exit_code"] == 3
    assert c["reason"] == "exit code 3"
    log = Path(c["log_path"]).read_text()
    assert log.strip() == f"sm={expected} cvd=unset mine=kept"


def test_submit_validation_refuses_and_changes_nothing(daemon: DaemonProc) -> None:
    before = daemon.call("list", {"all": True})["clients"]
    cases = [
        ({"gpu": "7"}, ErrorCode.NOT_FOUND, "no GPU '7'"),
        ({"gpu": "GPU-nope"}, ErrorCode.NOT_FOUND, "no GPU"),
        ({"sm_pct": 0}, ErrorCode.INVALID_PARAMS, "--sm"),
        ({"sm_pct": 150}, ErrorCode.INVALID_PARAMS, "--sm"),
        ({"mem_bytes": 15 << 30}, ErrorCode.NO_CAPACITY, "kept for online clients"),
        ({"slo_p99_ms": 10.0}, ErrorCode.INVALID_PARAMS, "--online"),
        ({"argv": []}, ErrorCode.INVALID_PARAMS, "no command"),
        ({"cls": "batch"}, ErrorCode.INVALID_PARAMS, "online"),
        (
            {"cls": "online", "latency_from": "http://10.0.0.1/m"},
            ErrorCode.INVALID_PARAMS,
            "--latency-from",
        ),
        (
            {"latency_from": "prometheus:http://127.0.0.1:1/m#h"},
            ErrorCode.INVALID_PARAMS,
            "--online",
        ),
    ]
    for params, code, text in cases:
        with pytest.raises(ApiError) as info:
            daemon.submit_detached(params.pop("argv", ["true"]), **params)
        assert info.value.code is code, (params, info.value)
        assert text in info.value.message
    after = daemon.call("list", {"all": True})["clients"]
    assert after == before  # nothing was recorded for refused submits


def test_missing_program_fails_with_a_reason(daemon: DaemonProc) -> None:
    # The program is looked up as the user, after the switch: a missing one is a failed client
    # whose reason says so (exit 127 from the launcher), or a refusal naming it.
    try:
        cid = daemon.submit_detached(["/nonexistent/program"])["client_id"]
    except ApiError as exc:
        refused = exc
    else:
        refused = None
    if refused is not None:
        assert (refused.code, "cannot start" in refused.message) == (ErrorCode.INVALID_PARAMS, True)
        return
    wait_for(lambda: _state(daemon, cid) == "failed", what="launch failure")
    c = daemon.client(cid)
    assert c["exit_code"] == 127
    assert "not found" in c["reason"]


def test_foreground_submit_from_another_pid_namespace_adopts_the_caller(
    daemon: DaemonProc,
) -> None:
    # In a new PID namespace the CLI is pid 1 there; the daemon takes the caller's pid from the
    # connection (SO_PEERCRED, in its own namespace), so the submit works (b0c0ecb refused it:
    # "pid 1 given, the connection is pid N") and the process adopted is the caller, not pid 1.
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) on this machine")
    script = "import os; print(os.getpid(), os.environ['GPUSHARE_CLIENT_ID'], flush=True)"
    r = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-m", "gpushare", "submit",
         "--offline", "--gpu", "0", "--", sys.executable, "-c", script],
        cwd=REPO, env={**os.environ, "GPUSHARE_SOCKET": str(daemon.socket)},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if "Operation not permitted" in r.stderr:
        pytest.skip(f"cannot make a PID namespace here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    inner_pid, cid = r.stdout.split()
    assert inner_pid == "1"
    c = daemon.client(cid)
    assert c["pid"] not in (None, 1)


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


def test_kill9_leaves_workloads_and_restart_readopts(tmp_path: Path) -> None:
    d = DaemonProc()
    try:
        d.start()
        a = d.submit_detached(["sleep", "60"], name="a")
        b = d.submit_detached(["sleep", "60"], name="b")
        q = d.submit_detached([sys.executable, "-c", "while True: pass"], name="busy")
        d.call("pause", {"client_id": q["client_id"]})
        d.kill9()
        # The workloads outlive the daemon.
        for r in (a, b, q):
            os.kill(r["pid"], 0)
        os.killpg(b["pid"], signal.SIGKILL)  # b dies while the daemon is down
        wait_for(lambda: not Path(f"/proc/{b['pid']}").exists() or b"Z" in Path(f"/proc/{b['pid']}/stat").read_bytes().split(b") ")[1][:1],
                 what="b to die")  # fmt: skip
        d.start()
        ca, cb, cq = d.client(a["client_id"]), d.client(b["client_id"]), d.client(q["client_id"])
        assert (ca["state"], ca["pid"]) == ("running", a["pid"])
        assert cb["state"] == "lost"
        assert "gone while the daemon was down" in cb["reason"]
        # The held client stays held (and frozen) across the restart.
        assert (cq["state"], cq["held"]) == ("frozen", True)
        t0 = cpu_ticks(q["pid"])
        import time

        time.sleep(0.4)
        assert cpu_ticks(q["pid"]) - t0 <= 1
        kinds = [e["kind"] for e in d.events()]
        assert kinds.count("client_readopted") == 2
        # The re-adopted client's exit is still noticed.
        d.call("cancel", {"client_id": a["client_id"]})
        wait_for(lambda: d.client(a["client_id"])["state"] == "exited", what="readopted exit")
        d.call("cancel", {"client_id": q["client_id"]})
        wait_for(lambda: d.client(q["client_id"])["state"] == "exited", what="frozen cancel")
        assert d.stop() == 0
    finally:
        d.cleanup()


def test_sigterm_leaves_workloads_running_and_exits_0() -> None:
    d = DaemonProc()
    try:
        d.start()
        r = d.submit_detached(["sleep", "60"])
        assert d.stop(signal.SIGTERM) == 0
        os.kill(r["pid"], 0)  # still alive
        assert not d.socket.exists()
        d.start()
        assert d.client(r["client_id"])["state"] == "running"
    finally:
        d.cleanup()


def test_bad_config_on_sighup_keeps_old_config() -> None:
    d = DaemonProc()
    try:
        d.start()
        d.config_path.write_text(d.config_text() + '\n[control]\nperiod = "fast"\n')
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        ev = wait_for(
            lambda: [e for e in d.events() if e["kind"] == "config_reload_failed"],
            what="reload failure",
        )
        assert "control.period" in ev[0]["message"]
        assert ev[0]["severity"] == "error"
        assert d.call("status")["daemon"]["ready"] is True
        # A good file is taken: cancel grace becomes 1s.
        d.config_path.write_text(
            d.config_text().replace('cancel_grace = "2s"', 'cancel_grace = "1s"')
        )
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: any(e["kind"] == "config_reloaded" for e in d.events()), what="reload")
        cid = d.submit_detached(["sleep", "30"])["client_id"]
        assert d.call("cancel", {"client_id": cid})["grace_s"] == 1.0
    finally:
        d.cleanup()


def test_sd_notify_ready_status_and_watchdog() -> None:
    base_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    d = DaemonProc()
    notify_path = d.base / "notify.sock"
    base_sock.bind(str(notify_path))
    base_sock.settimeout(10)
    d.env = {"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "200000"}
    try:
        d.start()
        got: list[str] = []
        while not ({"READY=1", "WATCHDOG=1"} <= set(got)):
            got += base_sock.recv(4096).decode().split("\n")
        ready_at = got.index("READY=1")
        assert any(f.startswith("STATUS=2 GPU(s), MPS up 2/2") for f in got)
        assert ready_at < got.index("WATCHDOG=1") or "WATCHDOG=1" in got[ready_at:]
        # A workload never inherits the daemon's systemd variables.
        r = d.submit_detached(["sh", "-c", "echo ${NOTIFY_SOCKET-none} ${WATCHDOG_USEC-none}"],
                              env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "/x"})  # fmt: skip
        wait_for(lambda: d.client(r["client_id"])["state"] == "exited", what="exit")
        assert Path(r["log_path"]).read_text().strip() == "none none"
        d.stop()
        tail = base_sock.recv(4096).decode()
        while "STOPPING=1" not in tail:
            tail = base_sock.recv(4096).decode()
    finally:
        base_sock.close()
        d.cleanup()


def test_not_ready_while_mps_down() -> None:
    d = DaemonProc(gpus=1)
    notify_path = d.base / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.settimeout(0.5)
    d.env = {"NOTIFY_SOCKET": str(notify_path)}
    state_file = d.base / "run" / "mps" / f"{fake_uuid(0)}.state"
    state_file.parent.mkdir(parents=True)
    state_file.write_text("down")
    try:
        d.start()
        assert d.call("status")["daemon"]["ready"] is False
        with pytest.raises(ApiError) as info:
            d.submit_detached(["true"])
        assert info.value.code is ErrorCode.UNAVAILABLE
        r = run_cli(d, "status")
        assert r.returncode == 1
        assert "down" in r.stdout
        state_file.write_text("up")
        wait_for(lambda: d.call("status")["daemon"]["ready"], what="ready after MPS up")
        fields: list[str] = []
        while "READY=1" not in fields:
            fields += sock.recv(4096).decode().split("\n")
    finally:
        sock.close()
        d.cleanup()


def test_cli_unreachable_socket_exit_3(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "gpushare", "status", "--socket", str(tmp_path / "none.sock")],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert r.returncode == 3
    assert r.stderr.strip() == (
        f"cannot reach gpushare at {tmp_path / 'none.sock'}: is gpushare.service running? "
        "(systemctl status gpushare)"
    )


def test_cli_status_list_events(daemon: DaemonProc) -> None:
    cid = daemon.submit_detached(["sleep", "30"], name="listed")["client_id"]
    r = run_cli(daemon, "status", "-o", "wide")  # UUIDs whole: -o wide
    assert r.returncode == 0, r.stderr
    assert fake_uuid(0) in r.stdout
    assert "listed" in r.stdout
    js = json.loads(run_cli(daemon, "status", "--json", "--gpu", "1").stdout)
    assert js["schema_version"] == 2
    assert [g["index"] for g in js["gpus"]] == [1]
    assert js["gpus"][0]["gpu_util_pct"] is None  # unknown is null, never 0
    assert "N/A" in r.stdout
    assert cid in run_cli(daemon, "list").stdout
    assert "client_submitted" in run_cli(daemon, "events").stdout
    r = run_cli(daemon, "cancel", "c9999")
    assert r.returncode == 2
    assert "no client 'c9999'" in r.stderr
    assert run_cli(daemon, "cancel", cid).returncode == 0
    r = run_cli(daemon, "submit", "--online", "--offline", "--", "true")
    assert r.returncode == 2


def test_api_client_refuses_other_version(daemon: DaemonProc) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(daemon.socket))
    with s:
        s.sendall(
            b'{"id":1,"method":"status"}\n{"id":2,"method":"hello","params":{"api_version":99}}\n'
        )
        f = s.makefile("rb")
        first, second = json.loads(f.readline()), json.loads(f.readline())
    assert first["error"]["name"] == "HELLO_REQUIRED"
    assert second["error"]["name"] == "VERSION_MISMATCH"
    assert ApiClient.connect(daemon.socket).hello["api_version"] == 1


def test_status_fast_path_matches_typer_command(daemon: DaemonProc) -> None:
    from gpushare.cli.fast import _parse_status

    assert _parse_status(["--json", "--gpu", "1"]) == {"json": True, "gpu": "1"}
    assert _parse_status(["--socket=/x"]) == {"socket": "/x"}
    for unknown in (["--watch", "1"], ["--gpu"], ["--gpu", "1", "--gpu", "2"], ["--help"], ["-h"]):
        assert _parse_status(unknown) is None  # left to Typer
    fast = run_cli(daemon, "status", "--gpu", "0")
    typer_path = subprocess.run(
        [sys.executable, "-c", "import sys; from gpushare.cli.app import main; sys.argv[0] = 'gpushare'; main()",
         "status", "--gpu", "0", "--socket", str(daemon.socket)],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert (fast.returncode, typer_path.returncode) == (0, 0)
    strip = lambda text: [line for line in text.splitlines() if "UPTIME" not in line]  # noqa: E731
    assert strip(fast.stdout)[:4] == strip(typer_path.stdout)[:4]


@needs_root
def test_one_user_per_gpu_without_multiuser_mps() -> None:
    d = DaemonProc()
    try:
        d.start()
        d.submit_detached(["sleep", "30"], gpu="1")
        params = {"cls": "offline", "argv": ["sleep", "30"], "detach": True, "cwd": "/",
                  "env": {"PATH": os.environ["PATH"]}}  # fmt: skip
        refused = call_as(
            NOBODY, NOBODY, d.socket, "submit", {**params, "gpu": "1", "no_queue": True}
        )
        assert refused["error"] == "NO_CAPACITY"
        assert "one user at a time" in refused["message"]
        placed = call_as(NOBODY, NOBODY, d.socket, "submit", {**params, "gpu": "any"})
        assert placed["result"]["gpu_uuid"] == fake_uuid(0)
    finally:
        d.cleanup()


@needs_root
def test_a_gang_of_one_user_keeps_another_users_clients_off_every_gpu_it_uses() -> None:
    # Legacy MPS serves one uid per GPU: root's gang on GPUs 0 and 1 holds both for root, so
    # another user's submit to GPU 1 (not rank 0's GPU) is refused, and its gang cannot span it.
    d = DaemonProc()
    try:
        d.start()
        gang = d.submit_detached(["sleep", "30"], gpus="0,1")
        assert gang["gpu_uuid"] == fake_uuid(0)
        params = {"cls": "offline", "argv": ["sleep", "30"], "detach": True, "cwd": "/",
                  "env": {"PATH": os.environ["PATH"]}, "no_queue": True}  # fmt: skip
        for where in ({"gpu": "1"}, {"gpus": "2"}):
            refused = call_as(NOBODY, NOBODY, d.socket, "submit", {**params, **where})
            assert refused["error"] == "NO_CAPACITY", (where, refused)
            assert "one user at a time" in refused["message"]
    finally:
        d.cleanup()


REPORTER = (
    "import time; from gpushare.client import report_latency, flush_latency\n"
    "for _ in range(40): report_latency(0.05)\n"
    "flush_latency(); time.sleep(30)\n"
)


def test_app_reported_latency_reaches_status(daemon: DaemonProc) -> None:
    res = daemon.submit_detached([sys.executable, "-c", REPORTER], cls="online", gpu="1",
                                 slo_p99_ms=40.0)  # fmt: skip
    cid = res["client_id"]

    def p99() -> float | None:
        st = daemon.call("status", {"gpu": "1"})
        c = next(c for c in st["clients"] if c["id"] == cid)
        return c["latency"]["p99_ms"]

    assert wait_for(p99, what="app p99 in status") == pytest.approx(50.0)
    st = daemon.call("status", {"gpu": "1"})
    lat = next(c for c in st["clients"] if c["id"] == cid)["latency"]
    assert (lat["source"], lat["slo_p99_ms"]) == ("app", 40.0)
    assert lat["ratio"] == pytest.approx(50.0 / 40.0)
    assert lat["samples"] > 0
    r = run_cli(daemon, "status", "--gpu", "1", "-o", "wide")  # ratio and source: -o wide
    row = next(line for line in r.stdout.splitlines() if line.startswith(cid + " "))
    assert "50ms" in row and "40ms" in row and "1.25" in row and "app" in row
    slo = daemon.call("status", {"gpu": "1"})["gpus"][0]["online_slo"]
    assert slo["state"] == "degraded"
    assert slo["violating_clients"] == [cid]
    daemon.call("cancel", {"client_id": cid})
    wait_for(lambda: _state(daemon, cid) == "exited", what="cancel")


def test_corrupted_database_is_moved_aside_and_reported() -> None:
    d = DaemonProc()
    try:
        d.db.parent.mkdir(parents=True)
        d.db.write_bytes(b"\x00garbage, not SQLite\x00" * 64)
        d.start()
        ev = next(e for e in d.events() if e["kind"] == "registry_corrupt")
        assert ev["severity"] == "error"
        aside = [p for p in d.db.parent.iterdir() if ".corrupt-" in p.name]
        assert len(aside) == 1
        assert aside[0].read_bytes().startswith(b"\x00garbage")
        assert str(aside[0]) in ev["message"]
        wait_for(lambda: d.call("status")["daemon"]["ready"], what="ready on the fresh database")
    finally:
        d.cleanup()


def test_events_follow_prints_new_events(daemon: DaemonProc) -> None:
    import threading

    follow = subprocess.Popen(
        [sys.executable, "-m", "gpushare", "events", "--follow", "--socket", str(daemon.socket)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        assert follow.stdout is not None
        for line in follow.stdout:
            lines.append(line)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        wait_for(lambda: any("daemon_started" in line for line in lines), what="history printed")
        cid = daemon.submit_detached(["true"], name="followed")["client_id"]
        # A new event shows up while --follow keeps running.
        wait_for(
            lambda: any(f" {cid} " in line and "client_exited" in line for line in lines),
            what="the new client's exit in --follow",
        )
        assert follow.poll() is None
    finally:
        follow.kill()
        follow.wait()
        reader.join(timeout=5)


def test_socket_mode_and_group_from_config() -> None:
    import grp
    import stat as st

    d = DaemonProc()
    d.config_path.write_text(
        d.config_text().replace(
            "[daemon]\n", '[daemon]\nsocket_mode = "0660"\nsocket_group = "nogroup"\n'
        )
    )
    bad = DaemonProc()
    bad.config_path.write_text(
        bad.config_text().replace("[daemon]\n", '[daemon]\nsocket_group = "no-such-group-xyz"\n')
    )
    try:
        d.start()
        info = d.socket.stat()
        assert st.S_IMODE(info.st_mode) == 0o660
        assert info.st_gid == grp.getgrnam("nogroup").gr_gid
        # A group that does not exist stops the start with a message that names the fix.
        bad.start(wait=False)
        assert bad.proc is not None
        assert bad.proc.wait(timeout=20) == 1
        assert "socket_group 'no-such-group-xyz' does not exist" in bad.stderr_path.read_text()
    finally:
        d.cleanup()
        bad.cleanup()


def test_socket_directory_that_cannot_be_created_is_a_clear_startup_error(tmp_path: Path) -> None:
    from gpushare.daemon.server import ApiServer, ServerError

    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the socket's directory should be
    server = ApiServer(blocker / "run" / "gpushare.sock", {}, max_request_bytes=1024)
    with pytest.raises(ServerError, match=r"cannot create .*paths\.socket"):
        server.start()
    assert blocker.read_text() == ""
