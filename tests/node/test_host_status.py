"""The doctor's host probes of NVML and the CUDA driver, on this GPU-less machine and faked."""

import ctypes.util

from bench.support import fake_nvml
from gpushare.node import nvml, nvml_diag, probe_host


def test_nvml_host_status_without_a_driver_carries_the_hint(monkeypatch):
    lib = fake_nvml.healthy(0)
    lib.init_error = fake_nvml.LIBRARY_NOT_FOUND
    monkeypatch.setattr(nvml, "_load_pynvml", lambda: lib)
    ok, detail, hint = nvml_diag.host_status()
    assert not ok
    assert "nvmlInit" in detail
    assert "install the driver" in hint


def test_nvml_host_status_with_gpus(monkeypatch):
    monkeypatch.setattr(nvml, "_load_pynvml", lambda: fake_nvml.healthy(2))
    ok, detail, hint = nvml_diag.host_status()
    assert ok
    assert detail == "driver 550.54.15, 2 GPU(s)"
    assert hint == ""


def test_cuda_driver_status_matches_this_host():
    check = probe_host.driver_check()
    if ctypes.util.find_library("cuda") is None:
        # No NVIDIA driver here (CI): the line says what it could not check and names the fix.
        assert (check.ok, check.checked) == (False, False)
        assert "libcuda" in check.detail and "not checked" in check.detail
        assert "driver" in check.hint
    else:
        assert check.ok, check.detail
        assert "supports CUDA" in check.detail
