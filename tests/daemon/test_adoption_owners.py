"""Adoptions have owners (issue 27 item 7), with real second and third accounts.

A registration (``adopt`` with source and job, as a Slurm prolog sends it) belongs to the uid that
made it: another uid can neither replace it nor release it, and so cannot end the owner's
clients; root and the admin group can. A process that runs with rights its user lacks (mixed
uids, a setuid executable) is adopted by root's rules only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.accounts import Account
from bench.support.daemon_helpers import DaemonProc, call_as, wait_for
from gpushare.node.procs.facts import process_facts, runs_setuid

FAST = 'adopt_scan_period = "100ms"\nadopt_min_age = "200ms"'


@pytest.fixture
def token() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait(timeout=5)


def _daemon(admin: Account) -> DaemonProc:
    # One GPU, so an adopted process needs no GPUSHARE_GPU_UUID; the third account is the admin.
    d = DaemonProc(daemon_toml=FAST, gpus=1)
    d.config_path.write_text(
        d.config_text().replace('admin_group = ""', f'admin_group = "{admin.name}"')
    )
    return d


def _sleep_as(
    started: list[subprocess.Popen[bytes]], account: Account, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        ["sleep", "60"], env={"PATH": os.environ["PATH"], **env}, cwd="/",
        user=account.uid, group=account.gid, extra_groups=[],
    )  # fmt: skip
    started.append(proc)
    wait_for(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes() == b"sleep\x0060\x00", 5)
    return proc


def _client_of(d: DaemonProc, pid: int) -> dict[str, Any] | None:
    return next((c for c in d.call("status")["clients"] if c["pid"] == pid), None)


def _job(account: Account, token: str, job: str = "42") -> dict[str, Any]:
    return {"source": "slurm", "job": job, "uid": account.uid, "cls": "offline",
            "match_env": {"SLURM_JOB_ID": job, "GSTEST_OWNER": token}}  # fmt: skip


def test_another_uid_can_neither_replace_nor_release_a_registration(
    accounts: tuple[Account, Account, Account], started: list[subprocess.Popen[bytes]], token: str
) -> None:
    a, b, admin = accounts
    d = _daemon(admin).start()
    try:
        assert "result" in call_as(a.uid, a.gid, d.socket, "adopt", _job(a, token))
        work = _sleep_as(started, a, {"SLURM_JOB_ID": "42", "GSTEST_OWNER": token})
        client = wait_for(lambda: _client_of(d, work.pid), 10, "a's job process adopted")
        assert client["adopted_by"] == "slurm job 42"
        # b registers the same job for its own processes: the owner check refuses it.
        out = call_as(b.uid, b.gid, d.socket, "adopt", _job(b, token))
        assert out.get("error") == "PERMISSION_DENIED", out
        assert f"uid {a.uid} registered it" in out["message"]
        out = call_as(b.uid, b.gid, d.socket, "release", {"source": "slurm", "job": "42"})
        assert out.get("error") == "PERMISSION_DENIED", out
        time.sleep(0.3)
        assert d.client(client["id"])["state"] == "running"  # a's client untouched
        # The admin group may release it (and so may root); a's client then ends, thawed.
        out = call_as(admin.uid, admin.gid, d.socket, "release", {"source": "slurm", "job": "42"})
        assert out["result"]["released"] == [client["id"]]
        assert d.client(client["id"])["state"] == "exited"
        # Root may replace anyone's registration; a may not take it back from root.
        assert "result" in call_as(a.uid, a.gid, d.socket, "adopt", _job(a, token, "43"))
        d.call("adopt", _job(a, token, "43"))
        out = call_as(a.uid, a.gid, d.socket, "release", {"source": "slurm", "job": "43"})
        assert out.get("error") == "PERMISSION_DENIED", out
        assert d.call("release", {"source": "slurm", "job": "43"})["released"] == []
    finally:
        d.cleanup()


# Runs as root, then keeps root as its saved uid while acting as the account: what a setuid
# program does between its privileged steps.
MIXED = "import os, sys, time; os.setresgid({g}, {g}, 0); os.setresuid({u}, {u}, 0); time.sleep(60)"


def _mixed_uid_process(
    started: list[subprocess.Popen[bytes]], account: Account, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", MIXED.format(u=account.uid, g=account.gid)],
        env={"PATH": os.environ["PATH"], **env}, cwd="/",
    )  # fmt: skip
    started.append(proc)
    wait_for(lambda: f"\t{account.uid}\t" in _status_uid_line(proc.pid), 5, "the uid change")
    return proc


def _status_uid_line(pid: int) -> str:
    return next(
        x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Uid:")
    )


def test_setuid_processes_are_adopted_by_roots_rules_only(
    accounts: tuple[Account, Account, Account], started: list[subprocess.Popen[bytes]], token: str
) -> None:
    a, _, admin = accounts
    env = {"SLURM_JOB_ID": "42", "GSTEST_OWNER": token}
    d = _daemon(admin).start()
    try:
        proc = _mixed_uid_process(started, a, env)
        facts = process_facts(proc.pid, ["SLURM_JOB_ID"])
        assert facts is not None and facts.uid == a.uid and facts.setuid
        assert "result" in call_as(a.uid, a.gid, d.socket, "adopt", _job(a, token))
        refused = wait_for(
            lambda: [e["message"] for e in d.events() if f"pid {proc.pid} " in e["message"]],
            10, "the setuid refusal",
        )  # fmt: skip
        assert "runs with rights its user lacks (setuid)" in refused[0]
        assert _client_of(d, proc.pid) is None
        # Root's registration of the same job adopts it.
        d.call("adopt", _job(a, token))
        c = wait_for(lambda: _client_of(d, proc.pid), 10, "root's rule adopting it")
        assert c["uid"] == a.uid
        plain = _sleep_as(started, a, {})
        assert not runs_setuid(plain.pid)
    finally:
        d.cleanup()
        for p in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)


def test_a_setuid_executable_counts_even_when_its_uids_agree(
    accounts: tuple[Account, Account, Account], started: list[subprocess.Popen[bytes]]
) -> None:
    a = accounts[0]
    d = Path(tempfile.mkdtemp(prefix="gs-suid-", dir="/tmp"))
    try:
        d.chmod(0o755)
        exe = d / "sleep"
        shutil.copy2(shutil.which("sleep") or "/bin/sleep", exe)
        os.chown(exe, a.uid, a.gid)
        exe.chmod(0o4755)  # setuid to its own owner: run by that owner, every uid is the same
        proc = subprocess.Popen(
            [str(exe), "60"], cwd="/", user=a.uid, group=a.gid, extra_groups=[]
        )  # fmt: skip
        started.append(proc)
        wait_for(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes().endswith(b"60\x00"), 5)
        assert f"\t{a.uid}\t{a.uid}\t{a.uid}\t{a.uid}" in _status_uid_line(proc.pid)
        assert runs_setuid(proc.pid)
    finally:
        shutil.rmtree(d, ignore_errors=True)
