"""The doctor's CUDA lines: the driver read without bindings, bindings against it, NVRTC.

The driver is a fake libcuda (the three ctypes calls) and a fake ``/proc/driver/nvidia/version``;
the bindings are the installed wheel, or a stand-in of another major; NVRTC is the real wheel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpushare import config
from gpushare.cli import doctor_cmd
from gpushare.cli.app import app
from gpushare.cli.doctor import Status, run_checks
from gpushare.node import probe, probe_host
from gpushare.node.probe_host import DriverFacts
from tests.fakes.fake_host import FakeHost

VERSION_535 = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)


class FakeLibcuda:
    """libcuda.so.1's three entry points the check calls, returning CUresult codes."""

    def __init__(self, cuda_version: int, devices: int = 1, init_code: int = 0) -> None:
        self.cuda_version, self.devices, self.init_code = cuda_version, devices, init_code

    def cuDriverGetVersion(self, out: Any) -> int:
        out._obj.value = self.cuda_version
        return 0

    def cuInit(self, flags: int) -> int:
        return self.init_code

    def cuDeviceGetCount(self, out: Any) -> int:
        out._obj.value = self.devices
        return 0


def _facts(tmp_path: Path, lib: FakeLibcuda) -> DriverFacts:
    version = tmp_path / "version"
    version.write_text(VERSION_535)
    return probe_host.driver_facts(lambda: lib, version)


def _bindings_of(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    real = probe.load_bindings()
    fake = probe.Bindings(real.driver, real.nvrtc, "cuda.bindings.driver", version)
    monkeypatch.setattr(probe_host, "load_bindings", lambda: fake)


def test_the_driver_line_names_the_driver_and_the_cuda_version_it_supports(tmp_path):
    facts = _facts(tmp_path, FakeLibcuda(12020, devices=2))
    assert facts == DriverFacts(12020, "535.129.03", 2)
    check = probe_host.driver_check(facts)
    assert check.ok and check.detail == "driver 535.129.03 supports CUDA 12.2, 2 device(s)"
    no_gpu = probe_host.driver_check(_facts(tmp_path, FakeLibcuda(12020, init_code=100)))
    assert (no_gpu.ok, no_gpu.checked) == (False, True)
    assert "cuInit failed (100)" in no_gpu.detail and "CUDA_VISIBLE_DEVICES" in no_gpu.hint


def test_bindings_13_on_a_535_driver_fail_and_name_the_fix(tmp_path, monkeypatch):
    """The finding: cuda-python>=12.0 resolved to 13.x, which a 535 driver cannot run."""
    _bindings_of(monkeypatch, "13.5.0")
    check = probe_host.bindings_check(_facts(tmp_path, FakeLibcuda(12020)))
    assert (check.ok, check.checked) == (False, True)
    assert "cuda-bindings 13.5.0" in check.detail and "580.65.06" in check.detail
    assert "supports CUDA 12.2" in check.detail
    assert check.hint.startswith(probe_host.INSTALL[12]) and "580.65.06" in check.hint
    # The same bindings on a 580 driver are fine; 12.x runs on both.
    assert probe_host.bindings_check(DriverFacts(13000, "580.65.06", 1)).ok
    _bindings_of(monkeypatch, "12.9.10")
    ok = probe_host.bindings_check(_facts(tmp_path, FakeLibcuda(12020)))
    assert ok.ok and "needs driver >= 525.60.13" in ok.detail


def test_the_installed_bindings_are_cuda_12_and_run_on_a_525_driver():
    """pyproject.toml's choice: CUDA 12 bindings, which every driver from 525 runs."""
    b = probe.load_bindings()
    assert b.version.startswith("12."), b.version
    check = probe_host.bindings_check(DriverFacts(12000, "525.60.13", 1))
    assert check.ok, check


def test_without_a_driver_nothing_is_failed_for_what_was_not_seen(tmp_path):
    def missing() -> Any:
        raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")

    facts = probe_host.driver_facts(missing, tmp_path / "absent")
    driver, bindings = probe_host.driver_check(facts), probe_host.bindings_check(facts)
    assert (driver.checked, bindings.checked) == (False, False)
    assert "not checked" in driver.detail and "not checked" in bindings.detail
    host = FakeHost(
        cuda_probe=doctor_cmd._probe(driver), bindings_probe=doctor_cmd._probe(bindings)
    )
    lines = {r.name: r for r in run_checks(host, config.Config(), None)}
    assert lines["CUDA driver"].status is Status.WARN
    assert lines["CUDA bindings"].status is Status.WARN


def test_a_missing_nvrtc_is_one_line_naming_the_wheel(monkeypatch):
    """The finding: the FAIL message carried the loader's line break."""
    missing_library = probe.driver_missing_errors()[0]  # cuda-pathfinder's error

    class NoNvrtc:
        def nvrtcCreateProgram(self, *args: Any) -> Any:
            raise missing_library('Failure finding "libnvrtc.so.12"\n')

    real = probe.load_bindings()
    fake = probe.Bindings(real.driver, NoNvrtc(), "cuda.bindings.driver", "12.9.10")
    monkeypatch.setattr(probe_host, "load_bindings", lambda: fake)
    check = probe_host.nvrtc_check()
    assert not check.ok and "\n" not in check.detail
    assert check.detail == 'libnvrtc not found (Failure finding "libnvrtc.so.12")'
    assert "pip install nvidia-cuda-nvrtc-cu12" in check.hint


def test_the_real_doctor_here_names_the_bindings_and_nvrtc(tmp_path):
    """This machine: no driver, the wheel's bindings and NVRTC: what it could check, and what not."""
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[paths]\nruntime_dir = "{tmp_path}/run"\nstate_dir = "{tmp_path}/state"\n')
    out = CliRunner().invoke(app, ["doctor", "--config", str(cfg)]).output
    lines = {line.split("  ")[0]: line for line in out.splitlines() if not line.startswith(" ")}
    assert "cuda-bindings 12." in lines["CUDA bindings"]
    assert "OK" in lines["NVRTC"] and "NVRTC 12." in lines["NVRTC"]
    if ctypes.util.find_library("cuda") is None:
        assert "WARN" in lines["CUDA driver"] and "not checked" in lines["CUDA driver"]
        assert "WARN" in lines["CUDA bindings"] and "not checked" in lines["CUDA bindings"]


def test_the_worker_says_why_and_how_when_the_driver_cannot_run_the_bindings(monkeypatch):
    facts = DriverFacts(12020, "535.129.03", 1)
    monkeypatch.setattr(probe_host, "driver_facts", lambda: facts)
    real = probe.load_bindings()
    b13 = probe.Bindings(real.driver, real.nvrtc, "cuda.bindings.driver", "13.5.0")
    out = io.StringIO()
    assert probe.worker_main(["--count", "1"], bindings=b13, out=out) == probe.EXIT_UNAVAILABLE
    hello, unavailable = (json.loads(line) for line in out.getvalue().splitlines())
    assert hello["bindings_version"] == "13.5.0"
    assert unavailable["reason"] == (
        "cuda-bindings 13.5.0 need driver >= 580.65.06, but driver 535.129.03 supports CUDA "
        f"12.2: {probe_host.INSTALL[12]}"
    )
    assert probe_host.mismatch(real, facts) is None  # the 12.x this project installs runs there
