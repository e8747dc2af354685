"""The in-flight library is trusted at each launch, not only at daemon start (gpushare.trust).

A real daemon process (tests/support/daemon_proc.py) preloads a copy of the library from a
root-only directory. After the daemon has started, the copy is given to an unprivileged user, or
its directory is opened to all, as a user who could then replace it with code of their own would
find it: root's next shallow submit must run blocking, without the library, the refusal must be
counted in ``status``, and ``doctor`` must say FAIL with the path and the fix.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.support.daemon_helpers import DaemonProc, wait_for
from gpushare import config, native
from gpushare.cli import doctor_cmd
from gpushare.cli.doctor import Status, run_checks

NOBODY = 65534

DUMP_ENV = """
import json, os, sys, time
keys = ("LD_PRELOAD", "GPUSHARE_MAX_INFLIGHT", "CUDA_LAUNCH_BLOCKING")
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({k: os.environ.get(k) for k in keys}, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while True: time.sleep(0.05)
"""


def _give_to_a_user(lib: Path) -> None:
    # Replaced by a file of the user's own, as they would after writing their constructor.
    incoming = lib.with_name("incoming.so")
    incoming.write_bytes(lib.read_bytes())
    incoming.chmod(0o755)
    os.chown(incoming, NOBODY, NOBODY)
    os.replace(incoming, lib)


def _open_its_directory(lib: Path) -> None:
    lib.parent.chmod(0o777)


def _shallow(d: DaemonProc, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    sub = d.submit_detached(
        [sys.executable, "-c", DUMP_ENV, str(out)], env=env, queue="shallow", cwd=str(out.parent)
    )
    wait_for(out.exists, 10.0, "the shallow client's environment")
    return json.loads(out.read_text()), d.client(sub["client_id"])["offline"]["queue"]


@pytest.mark.parametrize("spoil", [_give_to_a_user, _open_its_directory])
def test_a_library_spoiled_after_start_is_refused_at_the_next_launch(
    trusted_tmp: Path, tmp_path: Path, spoil: Callable[[Path], None]
) -> None:
    lib = trusted_tmp / "pkg" / native.LIBRARY_NAME
    lib.parent.mkdir(mode=0o755)
    lib.write_bytes(native.library_path().read_bytes() if native.built() else b"\x7fELF")
    lib.chmod(0o755)
    d = DaemonProc(
        '[gate]\nshallow_queue = "bounded"\ninflight_kernels = 3\n',
        gpus=1,
        inflight_library=lib,  # [paths] inflight_library: a copy the test can spoil
    )
    try:
        d.start()
        # Root's at start: preloaded.
        env, queue = _shallow(d, tmp_path / "before.json")
        assert env["LD_PRELOAD"] == str(lib)
        assert queue["shallow"] == "3 in flight"
        assert d.call("status")["daemon"]["trust_refusals"] == {}

        spoil(lib)
        env, queue = _shallow(d, tmp_path / "after.json")
        assert env == {"LD_PRELOAD": None, "GPUSHARE_MAX_INFLIGHT": None,
                       "CUDA_LAUNCH_BLOCKING": "1"}  # fmt: skip
        assert queue["shallow"] == "blocking"
        # Counted at each look (a launch computes its environment twice: shown, then spawned).
        refused = d.call("status")["daemon"]["trust_refusals"]
        assert list(refused) == ["the in-flight library"]
        assert refused["the in-flight library"] >= 1
    finally:
        d.cleanup()


@pytest.mark.parametrize("spoil", [_give_to_a_user, _open_its_directory])
def test_doctor_fails_on_a_library_another_user_could_change(
    trusted_tmp: Path, spoil: Callable[[Path], None]
) -> None:
    lib = trusted_tmp / "pkg" / native.LIBRARY_NAME
    lib.parent.mkdir(mode=0o755)
    lib.write_bytes(b"\x7fELF")
    lib.chmod(0o755)
    cfg = config.loads(f'[paths]\ninflight_library = "{lib}"\n[gate]\nshallow_queue = "bounded"\n')

    def line() -> Any:
        (r,) = [
            r
            for r in run_checks(doctor_cmd.RealHost(cfg), cfg, None)
            if r.name == "in-flight bound"
        ]
        return r

    assert line().status is Status.OK
    spoil(lib)
    r = line()
    assert r.status is Status.FAIL
    named = lib if spoil is _give_to_a_user else lib.parent
    assert f"the in-flight library {lib} is not trusted: {named} " in r.detail
    assert f"chown root:root {named} && chmod go-w {named}" in r.detail
