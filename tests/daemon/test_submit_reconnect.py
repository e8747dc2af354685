"""A foreground submit waiting in the queue lives through a daemon restart (issue 29).

On main at 7d264b7 the waiting ``gpushare submit`` exited 3 ("cannot reach gpushare") as soon as
the daemon went away, although its queued record survives the restart: now it says "daemon
restarting, reconnecting...", tries the socket again with a growing pause, and goes on waiting
for the same client id (gpushare/cli/waitq.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer

from bench.support.daemon_helpers import REPO, DaemonProc, wait_for
from gpushare.cli import waitq


@pytest.fixture
def one_gpu() -> Iterator[DaemonProc]:
    d = DaemonProc(gpus=1)
    try:
        yield d.start()
    finally:
        d.cleanup()


def _clients(d: DaemonProc) -> dict[str, dict[str, object]]:
    return {c["id"]: c for c in d.call("list", {"all": True})["clients"]}


def _submit(d: DaemonProc, *argv: str, detach: bool = True) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpushare", "submit", "--offline", "--mem", "4G",
         *(["--detach"] if detach else []), "--", *argv],
        cwd=REPO, env={**os.environ, "GPUSHARE_SOCKET": str(d.socket), "NO_COLOR": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_waiting_foreground_submit_reconnects_after_a_daemon_restart(one_gpu: DaemonProc):
    d = one_gpu
    for _ in range(3):  # three 4G jobs fill the 16G GPU (2G reserve, 1G used)
        done = _submit(d, "sleep", "60")
        assert done.wait(timeout=30) == 0, done.communicate()
    script = "import os; print('ran', os.environ['GPUSHARE_CLIENT_ID'], os.getpid(), flush=True)"
    fg = _submit(d, sys.executable, "-c", script, detach=False)
    try:
        wait_for(lambda: _clients(d).get("c4", {}).get("state") == "queued", 15.0, "c4 to queue")
        d.stop()
        time.sleep(1.5)  # it finds the daemon gone, and keeps trying
        assert fg.poll() is None, fg.communicate()
        d.start()
        assert _clients(d)["c4"]["state"] == "queued"
        time.sleep(1.5)  # back in the queue, asking again: it keeps its place
        assert _clients(d)["c4"]["state"] == "queued"
        d.call("cancel", {"client_id": "c1"})
        out, err = fg.communicate(timeout=30)
    finally:
        if fg.poll() is None:
            fg.send_signal(signal.SIGKILL)
            fg.wait()
    assert fg.returncode == 0, err
    assert "c4 queued: daemon restarting, reconnecting..." in err, err
    assert "c4: started on" in err, err
    word, cid, pid = out.split()
    assert (word, cid) == ("ran", "c4")
    # The same submitter, still the same client, became the workload in place.
    assert _clients(d)["c4"]["pid"] == int(pid) == fg.pid


def test_a_daemon_that_stays_away_ends_the_wait_with_exit_3(monkeypatch, tmp_path: Path, capsys):
    monkeypatch.setattr(waitq, "RECONNECT_FOR_S", 0.5)
    said: list[str] = []
    pauses: list[float] = []

    def sleep(s: float) -> None:
        pauses.append(s)
        time.sleep(0.05)

    with pytest.raises(typer.Exit) as ended:
        waitq.ask(str(tmp_path / "none.sock"), {"wait_for": "c9"}, lambda: said.append("x"),
                  sleep=sleep)  # fmt: skip
    assert ended.value.exit_code == 3
    err = capsys.readouterr().err
    assert "cannot reach gpushare" in err and "c9 leaves the queue" in err, err
    assert said and len(said) == len(pauses)
    assert pauses[:3] == [0.2, 0.4, 0.8]  # a growing pause, at most 2 s apart
    assert max(pauses) <= waitq.RECONNECT_PAUSE_S[1]


def test_a_socket_this_user_may_not_use_is_not_retried(tmp_path: Path, capsys):
    sock = tmp_path / "api.sock"
    import socket as so

    server = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    server.bind(str(sock))
    server.listen(1)
    sock.chmod(0o000)
    tries: list[float] = []
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.setgid(65534)
            os.setuid(65534)
            try:
                waitq.ask(str(sock), {"wait_for": "c1"}, lambda: None, sleep=tries.append)
            except typer.Exit as exc:
                os._exit(exc.exit_code)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
    finally:
        server.close()
    assert os.waitstatus_to_exitcode(status) == 4  # permission denied, at once
