"""The doctor's checks against a fake host: each failure gets the right status and a hint."""

from pathlib import Path

import pytest

from gpushare import config
from gpushare.cli import doctor_cmd
from gpushare.cli.doctor import (
    CheckResult,
    DirFacts,
    Probe,
    Status,
    load_config_for_doctor,
    render,
    run_checks,
)
from tests.fakes.fake_host import FakeHost


def _by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


def test_healthy_host_is_all_ok():
    results = run_checks(FakeHost(), config.Config(), None)
    assert {r.status for r in results} == {Status.OK}
    assert [r.name for r in results][:3] == ["Python", "NVML", "CUDA driver"]


def test_old_python_fails():
    r = _by_name(run_checks(FakeHost(version=(3, 8, 10)), config.Config(), None))["Python"]
    assert r.status is Status.FAIL
    assert "3.10" in r.hint


def test_missing_driver_fails_with_hint():
    host = FakeHost(nvml_probe=Probe(False, "NVML Shared Library Not Found"))
    r = _by_name(run_checks(host, config.Config(), None))["NVML"]
    assert r.status is Status.FAIL
    assert "install the NVIDIA driver" in r.hint


def test_adapter_hint_wins():
    host = FakeHost(
        nvml_probe=Probe(False, "Driver/library version mismatch", "reboot after a driver upgrade")
    )
    assert (
        _by_name(run_checks(host, config.Config(), None))["NVML"].hint
        == "reboot after a driver upgrade"
    )


def test_cuda_missing_fails_only_when_probe_enabled():
    host = FakeHost(cuda_probe=Probe(False, "cuInit: CUDA_ERROR_NO_DEVICE"))
    assert _by_name(run_checks(host, config.Config(), None))["CUDA driver"].status is Status.FAIL
    no_probe = config.loads("[probe]\nenabled = false\n")
    assert _by_name(run_checks(host, no_probe, None))["CUDA driver"].status is Status.WARN


def test_missing_nvrtc_fails_only_when_probe_enabled_and_names_the_fix():
    host = FakeHost(
        nvrtc_probe=Probe(False, "libnvrtc not found", "install NVRTC: the CUDA toolkit, or ...")
    )
    check = _by_name(run_checks(host, config.Config(), None))["NVRTC"]
    assert (check.status, check.hint.startswith("install NVRTC")) == (Status.FAIL, True)
    no_probe = config.loads("[probe]\nenabled = false\n")
    assert _by_name(run_checks(host, no_probe, None))["NVRTC"].status is Status.WARN


def test_real_nvrtc_check_compiles_the_probe_kernel():
    from gpushare.node import probe_host

    check = probe_host.nvrtc_check()
    # gpushare depends on the NVRTC wheel: the real compile runs here, no GPU needed.
    assert check.ok, (check.detail, check.hint)
    assert "CUBIN for sm_75" in check.detail


def test_missing_mps_binary_fails_and_skips_multiuser():
    host = FakeHost(mps_probe=Probe(False, "nvidia-cuda-mps-control not found on PATH"))
    cfg = config.loads('[mps]\ncontrol_binary = "/opt/nv/mps-control"\n')
    results = _by_name(run_checks(host, cfg, None))
    assert results["MPS control binary"].status is Status.FAIL
    assert "nvidia-cuda-mps" in results["MPS control binary"].hint
    assert "MPS multi-user" not in results
    assert host.asked_binary == ["/opt/nv/mps-control"]


@pytest.mark.parametrize(
    ("supported", "setting", "status"),
    [
        (True, "auto", Status.OK),
        (False, "auto", Status.WARN),
        (False, "on", Status.FAIL),
        (None, "off", Status.WARN),
    ],
)
def test_multiuser(supported, setting, status):
    cfg = config.loads(f'[mps]\nmultiuser = "{setting}"\n')
    r = _by_name(run_checks(FakeHost(multiuser=supported), cfg, None))["MPS multi-user"]
    assert r.status is status


def test_no_freezer_is_a_warning_with_fallback_hint():
    host = FakeHost(freezer_probe=Probe(False, "no cgroup2 mount in /proc/self/mounts"))
    r = _by_name(run_checks(host, config.Config(), None))["cgroup v2 freezer"]
    assert r.status is Status.WARN
    assert "SIGSTOP" in r.hint


def test_an_unbuilt_in_flight_bound_warns_only_where_it_is_used():
    host = FakeHost(inflight_probe=Probe(False, "/x/libgpushare_inflight.so: not built"))
    bounded = config.loads('[gate]\nshallow_queue = "bounded"\n')
    r = _by_name(run_checks(host, bounded, None))["in-flight bound"]
    assert r.status is Status.WARN
    assert "CUDA_LAUNCH_BLOCKING" in r.hint
    assert "sudo gpushare install" in r.hint
    assert "make native" not in r.hint  # a wheel user has no Makefile
    blocking = config.loads('[gate]\nshallow_queue = "blocking"\n')
    r = _by_name(run_checks(host, blocking, None))["in-flight bound"]
    assert r.status is Status.OK
    assert "not used" in r.detail
    built = _by_name(run_checks(FakeHost(), bounded, None))["in-flight bound"]
    assert built.status is Status.OK


def test_directories():
    cfg = config.loads('[paths]\nruntime_dir = "/r"\nstate_dir = "/s"\n')
    host = FakeHost(
        dirs={Path("/r"): DirFacts(False, False, True), Path("/s"): DirFacts(True, False, False)}
    )
    results = _by_name(run_checks(host, cfg, None))
    assert results["runtime directory"].status is Status.OK
    assert "will be created" in results["runtime directory"].detail
    assert results["state directory"].status is Status.FAIL
    assert "not writable" in results["state directory"].detail


def test_no_systemd_warns():
    r = _by_name(run_checks(FakeHost(booted_systemd=False), config.Config(), None))["systemd"]
    assert r.status is Status.WARN


def test_config_problems(tmp_path: Path):
    cfg, line = load_config_for_doctor(tmp_path / "none.toml")
    assert line.status is Status.WARN and cfg == config.Config()
    bad = tmp_path / "bad.toml"
    bad.write_text("[control]\nperiod = -1\n")
    _, line = load_config_for_doctor(bad)
    assert line.status is Status.FAIL
    assert "control.period" in line.detail
    good = tmp_path / "good.toml"
    good.write_text("[probe]\nenabled = false\n")
    cfg, line = load_config_for_doctor(good)
    assert line.status is Status.OK and cfg.probe.enabled is False


def test_a_valid_config_the_daemon_would_not_trust_fails(tmp_path: Path, trusted_tmp: Path):
    # The real rule (RealHost): a file under /tmp fails, the same file in a root-only directory
    # passes.
    details = {}
    for where, status in ((tmp_path, Status.FAIL), (trusted_tmp, Status.OK)):
        path = where / "gpushare.toml"
        path.write_text("[probe]\nenabled = false\n")
        cfg, line = load_config_for_doctor(path)
        assert line.status is Status.OK
        r = _by_name(run_checks(doctor_cmd.RealHost(cfg), cfg, line, path))["config"]
        assert r.status is status, r
        details[status] = r.detail
    shared = tmp_path / "gpushare.toml"
    assert details[Status.FAIL].startswith(
        f"the config file {shared} is not trusted: /tmp is a shared sticky directory"
    )
    assert "move it out of /tmp" in details[Status.FAIL]
    assert details[Status.OK] == str(trusted_tmp / "gpushare.toml")


def test_render_shows_hints_only_for_problems():
    text = render(
        [
            CheckResult("NVML", Status.OK, "fine", "never shown"),
            CheckResult("MPS control binary", Status.FAIL, "missing", "install it"),
        ]
    )
    assert "never shown" not in text
    assert "hint: install it" in text
    assert text.splitlines()[0].startswith("NVML                ")


def test_a_package_another_user_could_change_fails() -> None:
    host = FakeHost(package_probe=Probe(False, "the gpushare package /x is not trusted: ..."))
    r = _by_name(run_checks(host, config.Config(), None))["gpushare package"]
    assert r.status is Status.FAIL
    assert r.detail == "the gpushare package /x is not trusted: ..."
    assert r.hint == "install gpushare as root, where only root writes"
    assert _by_name(run_checks(FakeHost(), config.Config(), None))["gpushare package"].status is (
        Status.OK
    )
