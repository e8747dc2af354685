"""The plugin started before the kubelet: it waits, then registers once the kubelet's socket appears."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

from gpushare.k8s.devices import DaemonPaths, Gpu, PluginSettings
from gpushare.k8s.plugin import DevicePlugin
from tests.k8s.fake_kubelet import FakeKubelet

UUID = "GPU-00000000-1111-2222-3333-444444444449"


class _Source:
    def __init__(self) -> None:
        self.answer: tuple[list[Gpu], DaemonPaths] | str = (
            [Gpu(0, UUID, True)],
            DaemonPaths("/run/gs/mps", "/run/gs/latency.sock", "/run/gs/api.sock"),
        )

    def poll(self) -> tuple[list[Gpu], DaemonPaths] | str:
        return self.answer


def test_waits_for_the_kubelet_then_registers_and_follows_the_daemon() -> None:
    kdir = Path(tempfile.mkdtemp(prefix="klw-", dir="/tmp"))
    source = _Source()
    plugin = DevicePlugin(source, lambda *_a: {}, PluginSettings(online_replicas=2), kdir, 0.2)
    runner = threading.Thread(target=plugin.run, daemon=True)
    runner.start()
    kubelet = None
    try:
        time.sleep(1.5)
        assert plugin.registrations == 0
        assert list(kdir.iterdir()) == []  # no socket served while there is no kubelet
        kubelet = FakeKubelet(kdir)
        ep = kubelet.endpoint("gpushare.io/online")
        kubelet.wait(lambda: ep.devices == {f"{UUID}::0": "Healthy", f"{UUID}::1": "Healthy"})
        source.answer = "the daemon at /run/gs/api.sock did not answer"
        kubelet.wait(lambda: set(ep.devices.values()) == {"Unhealthy"}, what="unhealthy")
        assert plugin.registrations == 1
    finally:
        plugin.stop_event.set()
        runner.join(10)
        if kubelet is not None:
            kubelet.stop()
        shutil.rmtree(kdir, ignore_errors=True)
    assert not runner.is_alive()
    assert not (kdir / "gpushare-online.sock").exists()
