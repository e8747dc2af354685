"""The daemon's Prometheus exporter serves its state (an in-process daemon, a real HTTP listener)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gpushare import config
from gpushare.daemon.core import Daemon
from gpushare.daemon.registry import Registry
from gpushare.model import SetDuty
from gpushare.node.signal_pauser import SignalPauser
from tests.fakes.fake_gpu import FakeGpuBackend
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_policy import ScriptedPolicy
from tests.support.actions_daemon import GPU0, _submit


def test_metrics_exporter_serves_daemon_state() -> None:
    import socket
    import urllib.request

    from gpushare.metrics import Exporter

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    base = Path(tempfile.mkdtemp(prefix="gsm-", dir="/tmp"))
    cfg = config.loads(f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
[probe]
enabled = false
[metrics]
listen = "127.0.0.1:{port}"
""")
    policy = ScriptedPolicy(GPU0)
    d = Daemon(
        cfg, registry=Registry.open(cfg.paths.resolved("database")), gpu=FakeGpuBackend(),
        mps=FakeMpsNode(pipe_root=base / "mps"), pauser=SignalPauser(), policy=policy,
        notify=lambda *f: True, metrics=Exporter(),
    )  # fmt: skip
    d.start()
    try:
        r = _submit(d, ["sleep", "30"], sm_pct=40.0, name='say "hi" \\ 名前')
        policy.pending = [SetDuty(GPU0, 0.5, "test")]
        d.run(max_ticks=2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        client_line = next(
            line for line in text.splitlines()
            if line.startswith("gpushare_client_sm_limit_ratio") and r["client_id"] in line
        )  # fmt: skip
        assert client_line.endswith(" 0.4")
        throttles = [
            s for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "gpushare_throttle_events_total" and s.labels["UUID"] == GPU0
        ]  # fmt: skip
        assert [(s.labels["gpu"], s.value) for s in throttles] == [("0", 1.0)]
        assert {"Hostname", "modelName"} <= set(throttles[0].labels)
        m = {
            (s.name, s.labels.get("client")): s
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.labels.get("UUID") in (GPU0, None)
        }
        cid = r["client_id"]
        assert m[("gpushare_client_thawed_seconds_total", cid)].value > 0
        assert m[("gpushare_client_thawed_seconds_total", cid)].labels["name"] == 'say "hi" \\ 名前'
        assert 0 < m[("gpushare_client_thawed_ratio", cid)].value <= 1
        assert m[("gpushare_client_restarts_total", cid)].value == 0
        assert m[("gpushare_client_evictions_total", cid)].value == 0
        assert m[("gpushare_evictions_total", None)].value == 0
        assert m[("gpushare_controller_step_seconds_count", None)].value == 2  # two ticks
        assert m[("gpushare_admission_queue_length", None)].value == 0
        events = {
            (s.labels["kind"], s.labels["gpu"]): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "gpushare_events_total"
        }
        assert events[("offline_throttled", "0")] == 1  # the SetDuty above, on GPU 0
        assert events[("daemon_started", "")] == 1
    finally:
        os.killpg(r["pid"], signal.SIGKILL)
        d.shutdown()
        d.registry.close()
        shutil.rmtree(base, ignore_errors=True)
