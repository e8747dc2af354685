"""Runs a real gpushare daemon process with a fake GPU and fake MPS (``python -m tests.support.daemon_proc CONFIG``).

Everything else is real: the controller, the socket, SQLite, signals, child processes, the pauser.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from bench.support import crash_points
from gpushare import config
from gpushare.control.registry import make_policy
from gpushare.daemon.core import Daemon
from gpushare.daemon.registry import Registry, RegistryError
from gpushare.daemon.statedir import open_registry
from gpushare.logs import configure_logging
from gpushare.node.adopted import AdoptingPauser
from gpushare.node.signal_pauser import SignalPauser
from gpushare.roots.daemon import StartupError, make_pauser, serve
from tests.fakes.fake_gpu import FakeGpuBackend, fake_uuid
from tests.fakes.fake_mps import FakeMpsNode


def _mps_node(cfg: config.Config) -> Any:
    """The fake MPS node, or with GPUSHARE_TEST_REAL_MPS=1 the real one over the real binary."""
    if not os.environ.get("GPUSHARE_TEST_REAL_MPS"):
        return FakeMpsNode(pipe_root=cfg.paths.resolved("mps_pipe_dir"))
    from bench.support.helpers import mps_server_dir
    from gpushare.node.mps import MpsNodeManager

    gpus = int(os.environ.get("GPUSHARE_TEST_GPUS", "2"))
    node = MpsNodeManager(cfg, [fake_uuid(i) for i in range(gpus)],
                          extra_path=[str(mps_server_dir() or "")])  # fmt: skip
    node.start()
    return node


def _gpu_and_probe(gpus: int) -> tuple[Any, Any]:
    """The fake GPU (and probe): with GPUSHARE_TEST_FAKE_GPU=duty, tests/fakes/fake_dutyprobe.py's."""
    if os.environ.get("GPUSHARE_TEST_FAKE_GPU") != "duty":
        return FakeGpuBackend(gpus=gpus), None
    from tests.fakes.fake_dutyprobe import DutyGpu, DutyProbe

    state_dir = Path(os.environ["GPUSHARE_TEST_STATE_DIR"])
    return DutyGpu(state_dir, gpus=gpus), DutyProbe(state_dir)


def _pauser(cfg: config.Config) -> Any:
    """The daemon's own choice, or with GPUSHARE_TEST_PAUSER=signal the signal fallback.

    Wrapped as the real daemon wraps it: adopted processes are paused where they are.
    """
    if os.environ.get("GPUSHARE_TEST_PAUSER") == "signal":
        return AdoptingPauser(SignalPauser())
    return AdoptingPauser(make_pauser(cfg).pauser)


def _registry(cfg: config.Config) -> Registry:
    """The registry as the daemon opens it; its one-line refusal on stderr (exit 1) like the daemon's."""
    try:
        return open_registry(cfg)
    except RegistryError as exc:
        print(f"gpushare: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def main() -> int:
    path = Path(sys.argv[1])
    cfg = config.load(path)
    configure_logging("debug" if os.environ.get("GPUSHARE_TEST_DEBUG") else "warning", json=True)
    gpu, probe = _gpu_and_probe(int(os.environ.get("GPUSHARE_TEST_GPUS", "2")))
    daemon = Daemon(
        cfg,
        registry=_registry(cfg),
        gpu=gpu,
        mps=_mps_node(cfg),
        pauser=_pauser(cfg),
        probe=probe,
        policy=make_policy(cfg.control.policy, cfg.control),
        config_path=path,
    )
    crash_points.install(daemon)
    try:
        return serve(daemon)
    except StartupError as exc:
        print(f"gpushare: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
