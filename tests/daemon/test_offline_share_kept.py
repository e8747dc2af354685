"""The offline SM share outlives a daemon restart (issue 27: it went back to 50 % and the running
offline jobs were restarted to apply the default)."""

from __future__ import annotations

import time
from pathlib import Path

from gpushare import config
from gpushare.control.registry import make_policy
from gpushare.daemon.core import Daemon
from gpushare.daemon.statedir import open_registry
from gpushare.model import ClientClass, SetOfflineShare
from gpushare.node.signal_pauser import SignalPauser
from tests.fakes.fake_gpu import FakeGpuBackend, fake_uuid
from tests.fakes.fake_mps import FakeMpsNode

GPU0 = fake_uuid(0)


def _daemon(base: Path) -> Daemon:
    cfg = config.loads(f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
[daemon]
admin_group = ""
[probe]
enabled = false
""")
    return Daemon(
        cfg, registry=open_registry(cfg), gpu=FakeGpuBackend(gpus=1), mps=FakeMpsNode(pipe_root=base / "mps"),
        pauser=SignalPauser(), policy=make_policy("gpushare", cfg.control), notify=lambda *f: True,
    )  # fmt: skip


def test_the_offline_share_survives_a_daemon_restart(tmp_path: Path) -> None:
    d = _daemon(tmp_path)
    default = d.state.default_sm(ClientClass.OFFLINE, GPU0)
    kept = default + 20.0
    d.loop.apply(SetOfflineShare(GPU0, kept, "online demand fell"), time.monotonic())
    d.registry.close()

    d = _daemon(tmp_path)
    assert d.state.offline_share == {GPU0: kept}
    assert d.state.default_sm(ClientClass.OFFLINE, GPU0) == kept
    # The controller starts from it: its first share is the kept one, so nothing running at
    # that share is restarted to apply a default.
    assert d.state.initial_policy_state(GPU0, time.monotonic()).share_pct == kept
    d.registry.close()
