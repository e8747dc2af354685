"""Fixtures of the daemon tests that several modules share.

``daemon``: one real daemon process per test module (tests/support/daemon_proc.py: a fake GPU and
fake MPS, the rest real), for the end-to-end tests (tests/daemon/test_daemon_submit.py,
test_daemon_cli.py, ...). A module that defines its own ``daemon`` uses that one.

``env``: the run loop and the appliers of every controller action, driven tick by tick in-process
(tests/daemon/test_daemon_duty.py, test_daemon_evict_restart.py, ...). Real registry, socket and
child processes, under both pausers (signals and cgroups); a scripted policy stands in for the
controller and the MPS side is a fake.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from bench.support.daemon_helpers import DaemonProc
from gpushare import config
from gpushare.daemon.core import Daemon
from gpushare.daemon.registry import Registry
from gpushare.node.base import Pauser
from gpushare.node.cgroups.pauser import CgroupPauser
from gpushare.node.signal_pauser import SignalPauser
from tests.fakes.fake_gpu import FakeGpuBackend
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_policy import ScriptedPolicy
from tests.support.actions_daemon import GPU0, stop_daemon


@pytest.fixture(params=["signal", "cgroup"])
def env(request: pytest.FixtureRequest) -> Iterator[tuple[Daemon, ScriptedPolicy, FakeMpsNode]]:
    """An in-process daemon, its scripted policy and fake MPS node, under each pauser in turn."""
    cg_base = None
    if request.param == "cgroup":
        if (reason := cgroup_skip_reason()) is not None:
            pytest.skip(reason)
        cg_base = unique_base("gs-actions-test")
        pauser: Pauser = CgroupPauser(cg_base)
    else:
        pauser = SignalPauser()
    base = Path(tempfile.mkdtemp(prefix="gsa-", dir="/tmp"))
    cfg = config.loads(f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
[daemon]
cancel_grace = "1s"
[control]
period = "100ms"
evict_grace = "500ms"
[probe]
enabled = false
""")
    policy = ScriptedPolicy(GPU0)
    mps = FakeMpsNode(pipe_root=base / "mps")
    d = Daemon(
        cfg, registry=Registry.open(cfg.paths.resolved("database")), gpu=FakeGpuBackend(),
        mps=mps, pauser=pauser, policy=policy, notify=lambda *f: True,
    )  # fmt: skip
    d.start()
    try:
        yield d, policy, mps
    finally:
        stop_daemon(d)
        if cg_base is not None:
            remove_tree(cg_base)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProc]:
    """A real daemon process shared by the tests of one module."""
    d = DaemonProc().start()
    yield d
    d.cleanup()
