"""Issue 32 end to end: a real daemon switches a ``--queue auto`` client's queue without a restart.

The in-flight library is really preloaded into a real (CUDA-free) process: its constructor maps
the GPU's control file (``GPUSHARE_INFLIGHT_CONTROL``), which ``/proc/<pid>/maps`` shows, and the
daemon rewrites that file when request gating turns on. No CUDA here: that the library obeys the
file at each launch is tested in tests/native (test_inflight.py, the control-file tests).
"""

from __future__ import annotations

import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.support.daemon_helpers import DaemonProc, library_for_others, wait_for
from gpushare import native
from tests.daemon.test_e2e_gating import IDLE, SERVICE, _gate

# A root-owned copy, named by [paths] inflight_library: the clone may be private (a 0700 home).
pytestmark = pytest.mark.skipif(
    not native.built(), reason="the in-flight library is not built (make native needs a C compiler)"
)


def _bound(path: Path) -> int:
    return int(struct.unpack("<i", path.read_bytes())[0])


def test_an_auto_client_turns_shallow_when_gating_turns_on_in_the_same_process(
    tmp_path: Path,
) -> None:
    d = DaemonProc("", gpus=1, inflight_library=library_for_others())
    try:
        d.start()
        cmd = tmp_path / "cmd"
        cmd.mkdir()
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        # No --queue: auto is the default for --offline (issue 32).
        off = d.submit_detached([sys.executable, "-c", IDLE], env=env, restartable=True)
        cid = off["client_id"]
        assert d.client(cid)["offline"]["queue"]["asked"] == "auto"

        # A GPU with no online work starts at its ceiling (100 %), so the job is admitted
        # there (a job just admitted under the default 50 % would wait out the restart's
        # break-even before its raise, restart_cost.verdict); it is taken once it runs at 100 %.
        def settled() -> dict[str, Any] | None:
            c = d.client(cid)
            ok = c["state"] in ("running", "throttled") and c["sm_pct"] == 100.0
            return c if ok else None

        pid = wait_for(settled, 20.0, "the job at the share of a GPU without online work")["pid"]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        control = next(
            Path(v.split(b"=", 1)[1].decode())
            for v in environ
            if v.startswith(native.CONTROL_ENV.encode() + b"=")
        )
        assert _bound(control) == 0, "gating off: launched deep (unbounded)"
        # The real library mapped the file at start.
        wait_for(
            lambda: str(control) in Path(f"/proc/{pid}/maps").read_text(),
            10.0,
            "the control file mapped by the preloaded library",
        )
        mine = f'"client_id": "{cid}"'

        def exits() -> int:
            lines = d.stderr_path.read_text().splitlines()
            return len([ln for ln in lines if "client_process_exited" in ln and mine in ln])

        exited = exits()
        d.submit_detached([sys.executable, "-c", SERVICE, str(cmd)], cls="online", env=env)
        (cmd / "0000-ping").touch()
        wait_for(lambda: _gate(d)["enabled"], 10.0, "gating on")
        k = 4  # [gate] inflight_kernels' default
        wait_for(lambda: _bound(control) == k, 5.0, "the bound written into the control file")
        wait_for(
            lambda: d.client(cid)["offline"]["queue"]["now"] == "shallow", 5.0, "status: shallow"
        )
        # Past the 1 s after which a deep auto client used to be relaunched shallow.
        time.sleep(2.0)
        c = d.client(cid)
        assert c["pid"] == pid, [
            (e["kind"], e["message"][:200]) for e in d.call("events", {"limit": 50})["events"]
        ]
        assert c["state"] in ("running", "throttled")
        assert exits() == exited, "no exit since gating turned on"
    finally:
        d.cleanup()


def test_a_job_submitted_with_queue_deep_opts_out(tmp_path: Path) -> None:
    d = DaemonProc("", gpus=1, inflight_library=library_for_others())
    try:
        d.start()
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        off = d.submit_detached([sys.executable, "-c", IDLE], env=env, queue="deep")
        assert d.client(off["client_id"])["offline"]["queue"]["asked"] == "deep"
        environ = Path(f"/proc/{off['pid']}/environ").read_bytes()
        assert native.CONTROL_ENV.encode() not in environ
        assert native.LIBRARY_NAME.encode() not in environ
    finally:
        d.cleanup()


def test_a_declared_restart_cost_is_kept_and_bad_ones_get_one_line(tmp_path: Path) -> None:
    from gpushare.client import ApiError
    from gpushare.daemon.registry import Registry

    d = DaemonProc("", gpus=1, inflight_library=library_for_others())
    try:
        d.start()
        env = {"PATH": os.environ["PATH"]}
        for bad in (-1.0, 1e9, "90s"):
            with pytest.raises(ApiError, match="restart-cost|restart_cost"):
                d.submit_detached([sys.executable, "-c", IDLE], env=env, restart_cost_s=bad)
        with pytest.raises(ApiError, match="applies to --offline"):
            d.submit_detached(
                [sys.executable, "-c", IDLE], cls="online", env=env, restart_cost_s=1.0
            )
        off = d.submit_detached([sys.executable, "-c", IDLE], env=env, restart_cost_s=90.0)
        reg = Registry.open(d.db)
        try:
            assert reg.get(off["client_id"]).restart_cost_s == 90.0
            # Nothing recorded for the refused ones: this is the only client.
            assert [r.id for r in reg.clients(include_final=True)] == [off["client_id"]]
        finally:
            reg.close()
    finally:
        d.cleanup()
