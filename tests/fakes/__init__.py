"""One fake per gpushare Protocol, each checked against it by ``tests/test_conformance.py``.

| Protocol (``gpushare.node.base`` unless named) | fake |
|---|---|
| ``NodePauser`` (and its capabilities) | :mod:`tests.fakes.fake_pauser` |
| ``DaemonGpuBackend`` | :mod:`tests.fakes.fake_gpu` (``DutyGpu`` in ``fake_dutyprobe`` builds on it) |
| ``DaemonMpsNode`` | :mod:`tests.fakes.fake_mps` |
| ``SlotHoldingProbe`` / ``LatencyProbe`` | :mod:`tests.fakes.fake_probe` (``DutyProbe``: the daemon's own clients as the GPU) |
| ``ComputeModeControl`` | :mod:`tests.fakes.fake_compute_mode` |
| ``gpushare.control.policy.Policy`` | :mod:`tests.fakes.fake_policy` |
| ``gpushare.cli.doctor.Host`` | :mod:`tests.fakes.fake_host` |

Also a clock a test moves (:mod:`tests.fakes.fake_clock`). Fakes of outside libraries that the
benches use as well (pynvml) are in ``bench/support/``; ``fake_probe`` also holds the fake
cuda-python bindings the real probe runs on.
"""
