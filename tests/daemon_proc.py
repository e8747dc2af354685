"""Runs a real gpushare daemon process with a fake GPU and fake MPS (``python -m tests.daemon_proc CONFIG``).

Everything else is real: the controller, the socket, SQLite, signals, child processes, the pauser.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gpushare import config
from gpushare.control.registry import make_policy
from gpushare.daemon.core import Daemon
from gpushare.daemon.main import StartupError, make_pauser, serve
from gpushare.daemon.registry import Registry
from gpushare.logs import configure_logging
from tests.fake_gpu import FakeGpuBackend
from tests.fake_mpsnode import FakeMpsNode


def main() -> int:
    path = Path(sys.argv[1])
    cfg = config.load(path)
    configure_logging("debug" if os.environ.get("GPUSHARE_TEST_DEBUG") else "warning", json=True)
    daemon = Daemon(
        cfg,
        registry=Registry.open(cfg.paths.resolved("database")),
        gpu=FakeGpuBackend(gpus=int(os.environ.get("GPUSHARE_TEST_GPUS", "2"))),
        mps=FakeMpsNode(cfg.paths.resolved("mps_pipe_dir")),
        pauser=make_pauser(cfg).pauser,
        policy=make_policy(cfg.control.policy, cfg.control),
        config_path=path,
    )
    try:
        return serve(daemon)
    except StartupError as exc:
        print(f"gpushare: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
