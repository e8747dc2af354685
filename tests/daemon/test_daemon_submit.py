"""The daemon end to end: submit, foreground and detached (the MPS environment, priorities, exit
codes, refused parameters, a missing program, a caller in another PID namespace).

A real daemon process, real socket, SQLite, signals and workloads; only the GPU
(tests/fakes/fake_gpu.py) and the MPS side (tests/fakes/fake_mps.py) are fakes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.support.daemon_helpers import REPO, DaemonProc, wait_for
from gpushare.client import ApiError
from gpushare.protocol import ErrorCode
from tests.fakes.fake_gpu import fake_uuid
from tests.support.daemon_e2e import _state, run_cli

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
