"""The probe's window: nearest-rank p99, pruning, the baseline learned without offline work, stalls."""

from __future__ import annotations

import pytest

from gpushare.node import probe_window
from gpushare.node.probe_window import ProbeWindow


def test_window_p99_and_pruning() -> None:
    w = ProbeWindow(window_s=10, baseline_window_s=60, period_s=0.05)
    for i in range(100):
        w.add(at_s=i * 0.05, latency_ms=1.0 + (i == 50) * 9.0, run_ms=0.5)
    r = w.reading(now=5.0)
    assert r.samples == 100
    assert r.latency_ms == 1.0  # one outlier in 100 is the 100th percentile, not the 99th
    assert r.run_ms == 0.5
    assert r.ratio is None
    assert r.reason is not None
    assert "baseline" in r.reason
    # 20 s later every sample has left the window.
    r = w.reading(now=25.0)
    assert r.samples == 0
    assert r.latency_ms is None
    assert r.reason == "no samples yet"


def test_baseline_is_learned_only_without_offline_work_and_kept() -> None:
    w = ProbeWindow(window_s=10, baseline_window_s=60, period_s=0.05)
    t = 0.0
    for _ in range(50):  # offline work running: no baseline
        w.add(t, 5.0, 0.5)
        t += 0.05
    assert w.baseline_ms is None
    w.offline_running = False
    for _ in range(probe_window.BASELINE_MIN_SAMPLES):
        w.add(t, 1.0, 0.5)
        t += 0.05
    assert w.baseline_ms == 1.0
    w.offline_running = True
    for _ in range(400):  # long offline phase: baseline kept, latency rises
        w.add(t, 3.0, 0.5)
        t += 0.05
    r = w.reading(t)
    assert r.baseline_ms == 1.0
    assert r.latency_ms == 3.0
    assert r.ratio == pytest.approx(3.0)
    assert r.reason is None
    # Quiet again: the baseline follows the new quiet level (kept fresh).
    w.offline_running = False
    for _ in range(2000):
        w.add(t, 1.2, 0.5)
        t += 0.05
    assert w.baseline_ms == 1.2


def test_a_stalled_probe_counts_as_slow() -> None:
    w = ProbeWindow(window_s=10, baseline_window_s=60, period_s=0.05)
    w.offline_running = False
    for i in range(40):
        w.add(i * 0.05, 1.0, 0.5)
    last = 39 * 0.05
    # No sample for 0.5 s: a launch has been waiting ~450 ms.
    r = w.reading(last + 0.5)
    assert r.latency_ms == pytest.approx(450.0)
    assert r.ratio == pytest.approx(450.0)
