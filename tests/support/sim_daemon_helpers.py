"""``gpushare daemon --simulate N`` as a subprocess under a fresh /tmp directory, for end-to-end tests.

Used by ``tests/sim/test_sim_daemon.py`` (simulated MPS) and ``tests/sim/test_sim_hybrid_mps.py`` (the
real MPS control binary). The daemon gets real cgroup v2 where the machine allows it, in a
directory of its own; everything it started is cancelled and removed on exit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from bench.support.daemon_helpers import library_for_others
from bench.support.trusted import make_trusted_dir
from gpushare.paths import repo_root

GPUSHARE = [sys.executable, "-c", "from gpushare.cli.app import main; main()"]
CANCEL_GRACE_S = 1.0


def sim_config(base: Path, mps_control: Path, *, daemon: str = "", rest: str = "") -> Path | None:
    """Write ``base/gpushare.toml``; returns the cgroup directory it names, if any.

    ``daemon`` adds lines to ``[daemon]``; ``rest`` adds lines to ``[mps]``, the last table, or
    whole tables after it.
    """
    cgroup_dir = unique_base("gs-sim-test") if cgroup_skip_reason() is None else None
    cgroup_line = f'cgroup_base = "{cgroup_dir}"' if cgroup_dir is not None else ""
    # A root-owned copy of the built in-flight library: the clone may be private (0700), whose
    # own copy other users' jobs could not preload, so auto queues would take the blocking path.
    lib = library_for_others()
    library_line = f'inflight_library = "{lib}"' if lib is not None else ""
    (base / "gpushare.toml").write_text(
        f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
{cgroup_line}
{library_line}
[daemon]
admin_group = ""
cancel_grace = "{CANCEL_GRACE_S:g}s"
{daemon}
[metrics]
enabled = false
[mps]
control_binary = "{mps_control}"
{rest}
"""
    )
    return cgroup_dir


def socket_env(base: Path) -> dict[str, str]:
    """The environment that points the CLI at the daemon under ``base``."""
    return {**os.environ, "GPUSHARE_SOCKET": str(base / "run" / "gpushare.sock")}


def _daemon_argv(base: Path, gpus: int = 1) -> list[str]:
    return [*GPUSHARE, "daemon", "--simulate", str(gpus), "--config", str(base / "gpushare.toml")]


def run_daemon(base: Path, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the daemon under ``base`` in the foreground: for a start that is expected to fail."""
    return subprocess.run(
        _daemon_argv(base), env=socket_env(base), cwd=repo_root(), capture_output=True, text=True,
        timeout=timeout_s, check=False,
    )  # fmt: skip


@dataclass
class SimDaemon:
    """A running ``gpushare daemon --simulate 1`` and the CLI that talks to it."""

    base: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    mps_control: Path

    @property
    def log(self) -> Path:
        return self.base / "daemon.log"

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*GPUSHARE, *args], env=self.env, capture_output=True, text=True, timeout=30,
            check=False,
        )  # fmt: skip

    def log_lines(self) -> list[dict[str, object]]:
        lines = self.log.read_text().splitlines()
        return [json.loads(x) for x in lines if x.startswith("{")]

    def events(self) -> list[str]:
        res = self.cli("events", "--json")
        return [json.loads(x)["kind"] for x in res.stdout.splitlines()]


@contextmanager
def sim_daemon(
    mps_control: Path,
    *,
    daemon: str = "",
    rest: str = "",
    after: Callable[[Path], None] | None = None,
    gpus: int = 1,
) -> Iterator[SimDaemon]:
    """Start the daemon on ``gpus`` simulated GPUs, wait for its socket, and on exit cancel its
    clients and stop it.

    ``after(base)`` runs last, also when the start failed: for what the daemon may leave behind
    (control daemons).
    """
    # Short (Unix socket path limit) and root's: the daemon refuses a config under /tmp.
    base = make_trusted_dir("gss-")
    cgroup_dir = sim_config(base, mps_control, daemon=daemon, rest=rest)
    env = socket_env(base)
    proc = subprocess.Popen(
        _daemon_argv(base, gpus),
        env=env,
        cwd=repo_root(),
        stdout=subprocess.DEVNULL,
        stderr=(base / "daemon.log").open("wb"),
    )
    d = SimDaemon(base, env, proc, mps_control)
    try:
        deadline = time.monotonic() + 20
        while not (base / "run" / "gpushare.sock").exists():
            assert proc.poll() is None, d.log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the simulated daemon did not start"
            time.sleep(0.1)
        yield d
    finally:
        try:
            if proc.poll() is None:
                listing = d.cli("list", "--json")
                if listing.returncode == 0 and (clients := json.loads(listing.stdout)["clients"]):
                    for client in clients:
                        d.cli("cancel", client["id"])
                    # The cancel grace: the daemon kills what ignored SIGTERM.
                    time.sleep(CANCEL_GRACE_S + 0.5)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if after is not None:
                after(base)
            shutil.rmtree(base, ignore_errors=True)
            if cgroup_dir is not None:
                remove_tree(cgroup_dir)
