"""The latency probe worker: NVRTC compile, the launch path on a fake driver, the worker process."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.node import probe
from gpushare.node.probe import (
    EXIT_ERROR,
    EXIT_STICKY,
    EXIT_UNAVAILABLE,
    ProbeError,
    ProbeWorker,
    compile_cubin,
    worker_main,
)
from tests.fakes.fake_probe import FakeDriver, FakeNvrtc, fake_bindings

REPO = Path(__file__).resolve().parents[2]
FAKE_UUID = "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"  # FakeDriver's uuid_bytes = 0..15


def real_nvrtc():  # type: ignore[no-untyped-def]
    """The real NVRTC bindings, or skip saying exactly what is missing."""
    try:
        b = probe.load_bindings()
    except probe.ProbeUnavailableError as exc:
        pytest.skip(f"cuda-python is not installed: {exc}")
    try:
        (status, major, _minor) = b.nvrtc.nvrtcVersion()
    except RuntimeError as exc:  # cuda.pathfinder.DynamicLibNotFoundError
        pytest.skip(
            f"NVRTC library not loadable ({exc}); install it: pip install nvidia-cuda-nvrtc"
        )
    assert int(status) == 0
    return b.nvrtc


@pytest.mark.parametrize(("major", "minor"), [(7, 5), (8, 0), (9, 0)])
def test_probe_kernel_compiles_to_a_cubin_with_nvrtc(major: int, minor: int) -> None:
    nvrtc = real_nvrtc()
    image = compile_cubin(nvrtc, major, minor)
    assert image.startswith(b"\x7fELF")
    assert probe.KERNEL_NAME.encode() in image
    # A CUBIN, not PTX: the ELF machine is EM_CUDA (190).
    assert int.from_bytes(image[18:20], "little") == 190


def test_nvrtc_errors_carry_the_compiler_log() -> None:
    nvrtc = real_nvrtc()
    with pytest.raises(ProbeError, match="nvrtcCompileProgram.*undefined_thing"):
        compile_cubin(nvrtc, 9, 0, source='extern "C" __global__ void k() { undefined_thing(); }')


def test_cuda_bindings_12_layout_is_used_when_13_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    driver12 = types.ModuleType("cuda.cuda")
    nvrtc12 = types.ModuleType("cuda.nvrtc")
    # None in sys.modules makes "from cuda.bindings import ..." fail as on a 12.x install.
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda.cuda", driver12)
    monkeypatch.setitem(sys.modules, "cuda.nvrtc", nvrtc12)
    b = probe.load_bindings()
    assert b.name == "cuda.cuda"
    assert b.driver is driver12
    assert b.nvrtc is nvrtc12


def test_no_cuda_python_at_all_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda.cuda", None)
    with pytest.raises(probe.ProbeUnavailableError, match="pip install"):
        probe.load_bindings()
    out = io.StringIO()
    assert worker_main(["--count", "1"], out=out) == EXIT_UNAVAILABLE
    assert json.loads(out.getvalue())["type"] == "unavailable"


def test_launch_path_against_a_fake_driver() -> None:
    b = fake_bindings(latencies_ms=[0.2, 0.3], run_ms=0.012)
    worker = ProbeWorker(b, FAKE_UUID.lower(), cycles=1234)
    info = worker.setup()
    assert info == {
        "gpu_uuid": FAKE_UUID,
        "compute_capability": "9.0",
        "sm_count": 132,
        "mps_enabled": True,
        "cubin_bytes": len(FakeNvrtc.IMAGE),
        "cycles": 1234,
        "blocks": 1,
    }
    drv: FakeDriver = b.driver
    nvrtc: FakeNvrtc = b.nvrtc
    assert nvrtc.options == [[b"--gpu-architecture=sm_90"]]
    assert nvrtc.sources[0] == probe.KERNEL_SOURCE.encode()
    assert drv.loaded_images == [FakeNvrtc.IMAGE]
    assert drv.stream_priority == -5  # the highest priority the context offers
    first, second = worker.measure(), worker.measure()
    assert (first["latency_ms"], second["latency_ms"]) == (0.2, 0.3)
    assert first["run_ms"] == pytest.approx(0.012)
    assert first["cycles"] == 1234
    assert first["host_ms"] >= 0
    assert drv.launches[0] == {"fn": "fn", "grid": (1, 1, 1), "block": (32, 1, 1), "cycles": 1234}
    worker.teardown()
    assert sorted(drv.destroyed) == ["ctx", "event", "event", "mem", "module", "stream"]


def test_busy_load_and_fault_injection_options() -> None:
    code, lines = run_worker(["--period-s", "0", "--count", "2", "--blocks", "4096"])
    assert code == 0
    assert lines[1]["blocks"] == 4096
    code, lines = run_worker(["--period-s", "0", "--count", "2", "--inject-fault"])
    assert code == EXIT_STICKY
    assert lines[-1]["code"] == 700


def test_a_gpu_that_is_not_visible_is_named() -> None:
    worker = ProbeWorker(fake_bindings(), "GPU-ffffffff-0000-0000-0000-000000000000", cycles=10)
    with pytest.raises(ProbeError, match=f"not visible to this process \\(visible: {FAKE_UUID}\\)"):
        worker.setup()


def run_worker(args: list[str], **driver_kw: object) -> tuple[int, list[dict[str, object]]]:
    out = io.StringIO()
    code = worker_main(args, bindings=fake_bindings(**driver_kw), out=out)
    return code, [json.loads(line) for line in out.getvalue().splitlines()]


def test_worker_exits_for_a_restart_on_a_sticky_error() -> None:
    code, lines = run_worker(["--period-s", "0", "--count", "10"], fail_at={3: 700})
    assert code == EXIT_STICKY
    assert [line["type"] for line in lines] == ["hello", "ready", "sample", "sample", "error"]
    assert lines[0]["bindings"] == "fake.driver"
    assert lines[-1]["code"] == 700
    assert lines[-1]["sticky"] is True
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in str(lines[-1]["message"])


@pytest.mark.parametrize("code", [719, 807, 810])
def test_every_sticky_error_asks_for_a_restart(code: int) -> None:
    assert run_worker(["--period-s", "0", "--count", "5"], fail_at={1: code})[0] == EXIT_STICKY


def test_a_non_sticky_error_is_an_ordinary_failure() -> None:
    code, lines = run_worker(["--period-s", "0", "--count", "5"], fail_at={2: 805})
    assert code == EXIT_ERROR
    assert lines[-1]["sticky"] is False


def test_worker_counts_and_stops() -> None:
    code, lines = run_worker(["--period-s", "0", "--count", "3"], latencies_ms=[0.1])
    assert code == 0
    assert [line["latency_ms"] for line in lines if line["type"] == "sample"] == [0.1, 0.1, 0.1]


def test_worker_without_a_driver_reports_unavailable() -> None:
    missing = probe.driver_missing_errors()[0]  # cuda.pathfinder.DynamicLibNotFoundError
    err = missing('"cuda" is an NVIDIA driver library')
    code, lines = run_worker(["--count", "1"], init_error=err)
    assert code == EXIT_UNAVAILABLE
    assert lines[-1]["type"] == "unavailable"
    assert "no CUDA driver" in str(lines[-1]["reason"])


def test_real_worker_process_on_this_driverless_host() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpushare.node.probe", "--count", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    if lines and lines[-1]["type"] == "sample":
        pytest.skip("this host has a working CUDA driver; the driverless path cannot be checked")
    assert proc.returncode == EXIT_UNAVAILABLE
    assert lines[0]["type"] == "hello"
    assert lines[0]["bindings"] in ("cuda.bindings.driver", "cuda.cuda")
    assert lines[-1]["type"] == "unavailable"


def test_worker_exits_when_its_parent_pipe_closes() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "FAKE_PROBE_SCRIPT": "{}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.fake_probe", "--period-s", "0.01", "--watch-stdin"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        assert json.loads(proc.stdout.readline())["type"] == "hello"
        proc.stdin.close()  # what the parent's death does
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
