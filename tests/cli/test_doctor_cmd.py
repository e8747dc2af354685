"""``gpushare doctor`` end to end: the command's exit code and output, and the real host's probes."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from gpushare import config
from gpushare.cli import doctor_cmd
from gpushare.cli.app import app
from gpushare.cli.doctor import Probe, Status
from tests.fakes.fake_host import FakeHost

runner = CliRunner()


def _config_file(tmp_path: Path, body: str = "") -> Path:
    f = tmp_path / "g.toml"
    f.write_text(f'[paths]\nruntime_dir = "{tmp_path}/run"\nstate_dir = "{tmp_path}/state"\n{body}')
    return f


@pytest.fixture
def fake_host(monkeypatch):
    host = FakeHost()
    monkeypatch.setattr(doctor_cmd, "RealHost", lambda cfg: host)
    return host


def test_healthy_host_exits_0(tmp_path, fake_host):
    result = runner.invoke(app, ["doctor", "--config", str(_config_file(tmp_path))])
    assert result.exit_code == 0, result.output
    assert "FAIL" not in result.output


def test_any_fail_exits_1_and_json_lists_it(tmp_path, fake_host):
    fake_host.mps_probe = Probe(False, "nvidia-cuda-mps-control not found")
    result = runner.invoke(app, ["doctor", "--json", "--config", str(_config_file(tmp_path))])
    assert result.exit_code == 1
    lines = {r["name"]: r for r in json.loads(result.output)["checks"]}
    assert lines["MPS control binary"]["status"] == "FAIL"
    assert lines["MPS control binary"]["hint"]


def test_warnings_alone_exit_0(tmp_path, fake_host):
    fake_host.booted_systemd = False
    fake_host.freezer_probe = Probe(False, "no cgroup2")
    result = runner.invoke(app, ["doctor", "--config", str(_config_file(tmp_path))])
    assert result.exit_code == 0
    assert "WARN" in result.output


def test_bad_config_is_a_fail_line(tmp_path, fake_host):
    f = _config_file(tmp_path, "[control]\nperiod = 'never'\n")
    result = runner.invoke(app, ["doctor", "--config", str(f)])
    assert result.exit_code == 1
    assert "control.period" in result.output


def test_real_host_finds_and_runs_the_mps_binary(mps_control: Path):
    host = doctor_cmd.RealHost(config.Config())
    ok = host.mps_binary(str(mps_control))
    assert ok.ok, ok.detail
    missing = host.mps_binary("/nonexistent/nvidia-cuda-mps-control")
    assert not missing.ok
    assert "not found" in missing.detail
    assert host.mps_multiuser(str(mps_control)) is (
        b"-multiuser-server" in mps_control.read_bytes()
    )


def test_real_host_mps_binary_that_does_not_run(trusted_tmp: Path):
    fake = trusted_tmp / "nvidia-cuda-mps-control"
    fake.write_text("#!/bin/sh\necho 'segmentation fault' >&2\nexit 139\n")
    fake.chmod(0o755)
    probe = doctor_cmd.RealHost(config.Config()).mps_binary(str(fake))
    assert not probe.ok
    assert "exit 139" in probe.detail


def test_real_host_freezer_check_leaves_nothing_behind():
    if (reason := cgroup_skip_reason()) is not None:
        pytest.skip(reason)
    base = unique_base("gpushare-doctor")
    try:
        cfg = config.loads(f'[paths]\ncgroup_base = "{base}"\n')
        probe = doctor_cmd.RealHost(cfg).cgroup_freezer()
        assert probe.ok, probe.detail
        assert not base.exists()
    finally:
        remove_tree(base)


def test_real_host_directories(tmp_path: Path):
    host = doctor_cmd.RealHost(config.Config())
    assert host.directory(tmp_path).writable
    facts = host.directory(tmp_path / "a" / "b")
    assert not facts.exists
    assert facts.creatable


def test_full_real_run_reports_every_line(tmp_path: Path, mps_control: Path):
    f = _config_file(tmp_path, f'[mps]\ncontrol_binary = "{mps_control}"\n')
    result = runner.invoke(app, ["doctor", "--json", "--config", str(f)])
    lines = {r["name"]: r for r in json.loads(result.output)["checks"]}
    assert lines["MPS control binary"]["status"] == Status.OK.value
    assert lines["runtime directory"]["status"] == Status.OK.value
    expected_exit = 1 if any(r["status"] == "FAIL" for r in lines.values()) else 0
    assert result.exit_code == expected_exit
