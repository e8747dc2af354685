"""The probe's parent: real worker subprocesses (a fake driver), readings, restarts, MPS slots."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpushare.config import ProbeConfig
from gpushare.node import probe_window
from gpushare.node.probe_manager import ProbeManager

REPO = Path(__file__).resolve().parents[2]
FAKE_UUID = "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"  # FakeDriver's uuid_bytes = 0..15


def wait_for(pred: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


@pytest.fixture
def managers() -> Iterator[list[ProbeManager]]:
    made: list[ProbeManager] = []
    yield made
    for m in made:
        m.close()


def fake_worker(script: dict[str, object]) -> tuple[Callable[[str], list[str]], dict[str, str]]:
    env = dict(os.environ)
    env["FAKE_PROBE_SCRIPT"] = json.dumps(script)
    env["PYTHONPATH"] = str(REPO)

    def argv(uuid: str) -> list[str]:
        return [
            sys.executable, "-m", "tests.fakes.fake_probe", "--gpu", FAKE_UUID, "--period-s", "0.01",
            "--watch-stdin",
        ]  # fmt: skip

    return argv, env


def test_manager_reads_samples_learns_baseline_and_holds_a_slot(
    managers: list[ProbeManager],
) -> None:
    cfg = ProbeConfig(period_s=0.01, window_s=5.0, baseline_window_s=30.0)
    argv, env = fake_worker({"latencies_ms": [0.05]})
    m = ProbeManager(cfg, worker_argv=argv)
    managers.append(m)
    m.start(FAKE_UUID, env)
    m.set_offline_running(FAKE_UUID, False)
    wait_for(lambda: m.reading(FAKE_UUID).ratio is not None)
    r = m.reading(FAKE_UUID)
    assert r.baseline_ms == pytest.approx(0.05)
    assert r.run_ms == pytest.approx(0.012)
    assert r.samples >= probe_window.BASELINE_MIN_SAMPLES
    st = m.status(FAKE_UUID)
    assert st.state == "running"
    assert st.mps_client_slots == 1
    assert m.mps_client_slots(FAKE_UUID) == 1
    assert st.bindings == "fake.driver 0.0"
    assert st.compute_capability == "9.0"
    assert st.mps_enabled is True
    assert st.pid is not None
    pid = st.pid
    m.close()
    assert m.mps_client_slots(FAKE_UUID) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_manager_restarts_a_worker_after_a_sticky_error(managers: list[ProbeManager]) -> None:
    cfg = ProbeConfig(period_s=0.01, restart_backoff_min_s=0.05, restart_backoff_max_s=0.2)
    argv, env = fake_worker({"fail_at": {"10": 700}})
    m = ProbeManager(cfg, worker_argv=argv)
    managers.append(m)
    m.start(FAKE_UUID, env)
    wait_for(lambda: m.status(FAKE_UUID).restarts >= 2)
    st = m.status(FAKE_UUID)
    assert st.last_error is not None
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in st.last_error
    wait_for(lambda: m.reading(FAKE_UUID).samples > 0)


def test_manager_without_a_driver_says_unavailable(managers: list[ProbeManager]) -> None:
    cfg = ProbeConfig(restart_backoff_max_s=60.0)
    m = ProbeManager(cfg)
    managers.append(m)
    m.start("GPU-00000000-0000-0000-0000-000000000000", {**os.environ, "PYTHONPATH": str(REPO)})
    uuid = "GPU-00000000-0000-0000-0000-000000000000"
    wait_for(lambda: m.status(uuid).state == "unavailable", timeout_s=60)
    r = m.reading(uuid)
    assert r.latency_ms is None
    assert r.reason is not None
    assert r.reason.startswith("unavailable: ")
    st = m.status(uuid)
    assert st.bindings is not None
    assert st.bindings.startswith(("cuda.bindings.driver", "cuda.cuda"))
    assert st.mps_client_slots == 0
    assert m.reading("GPU-other").reason == "unavailable: no probe started on this GPU"


def test_disabled_probe_reads_unavailable(managers: list[ProbeManager]) -> None:
    m = ProbeManager(ProbeConfig(enabled=False))
    managers.append(m)
    m.start(FAKE_UUID, {})
    assert m.reading(FAKE_UUID).reason == "unavailable: probe disabled in config"
    assert m.mps_client_slots(FAKE_UUID) == 0
