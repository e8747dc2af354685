"""Fixtures the node tests of several modules share.

Real cgroups (``cg_base``, ``pauser``) and child processes (``children``, ``started``) for the
``test_cgroups_*``, ``test_signal_pauser`` and ``test_procs_*`` modules; real MPS control daemons
(``short_root``, ``make_config``, ``make_supervisor``, ``sup``, ``quiet_logs``) for
``test_mps_supervisor``, ``test_mps_commands``, ``test_mps_setup`` and ``test_mps_node_manager``.
A module's own fixture of the same name wins over these (``test_mps_recovery.py`` has its own
``sup``, ``test_process_facts.py`` its own ``started``).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog

from bench.support.cgroup_helpers import remove_tree, unique_base
from bench.support.helpers import mps_server_dir
from gpushare.config import Config, MpsConfig, PathsConfig
from gpushare.node.cgroups.pauser import CgroupPauser
from gpushare.node.mps import MpsSupervisor
from tests.support.cgroup_marks import CGROUP_SKIP
from tests.support.mps_real import GPU_A, procs_using
from tests.support.processes import Children, Procs

# Real cgroups and processes ------------------------------------------------------------------


@pytest.fixture
def cg_base() -> Iterator[Path]:
    """A fresh directory beside this process's cgroup; killed and removed at teardown."""
    if CGROUP_SKIP is not None:
        pytest.skip(CGROUP_SKIP)
    base = unique_base("gpushare-test")
    yield base
    remove_tree(base)


@pytest.fixture
def pauser(cg_base: Path) -> CgroupPauser:
    # pids() read afresh on every call: these tests look at what the cgroup holds at each moment
    # (a transient subshell must be gone). Tracking pids on change has tests of its own
    # (test_cgroups_pids.py).
    return CgroupPauser(cg_base, freeze_timeout_s=2.0, pids_rescan_s=0.0)


@pytest.fixture
def children() -> Iterator[Children]:
    kids = Children()
    yield kids
    kids.cleanup()


@pytest.fixture
def started() -> Iterator[Procs]:
    kids = Procs()
    yield kids
    kids.cleanup()


# Real MPS control daemons ---------------------------------------------------------------------


@pytest.fixture
def quiet_logs() -> None:
    # Daemon output is logged at debug from background threads; keep test output readable.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


@pytest.fixture
def short_root() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: pytest's tmp_path plus a GPU UUID is too long.
    root = Path(tempfile.mkdtemp(prefix="gsm", dir="/tmp"))
    yield root
    for proc in procs_using(root):
        proc.kill()
        proc.wait(5)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def make_config(mps_control: Path, short_root: Path) -> Callable[..., Config]:
    def make(**mps_kw: object) -> Config:
        kw: dict[str, object] = {
            "control_binary": str(mps_control),
            "command_timeout_s": 2.0,
            "health_period_s": 0.2,
            "ready_timeout_s": 5.0,
            "restart_backoff_min_s": 0.05,
            "restart_backoff_max_s": 0.4,
            "quit_timeout_s": 1.0,
            "default_active_thread_pct": 40.0,
            "multiuser": "auto",
        }
        kw.update(mps_kw)
        return Config(
            paths=PathsConfig(runtime_dir=short_root, state_dir=short_root / "state"),
            mps=MpsConfig(**kw),  # type: ignore[arg-type]
        )

    return make


@pytest.fixture
def make_supervisor(make_config: Callable[..., Config]) -> Iterator[Callable[..., MpsSupervisor]]:
    made: list[MpsSupervisor] = []
    server_dir = mps_server_dir()

    def make(uuid: str = GPU_A, config: Config | None = None, **kw: object) -> MpsSupervisor:
        sup = MpsSupervisor(
            uuid,
            config or make_config(),
            extra_path=[server_dir] if server_dir else [],
            **kw,  # type: ignore[arg-type]
        )
        made.append(sup)
        return sup

    yield make
    for sup in made:
        sup.stop()


@pytest.fixture
def sup(make_supervisor: Callable[..., MpsSupervisor]) -> MpsSupervisor:
    s = make_supervisor()
    s.start()
    return s
