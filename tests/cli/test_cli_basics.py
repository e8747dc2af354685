"""The CLI skeleton through Typer's CliRunner: version, config check, usage errors."""

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from gpushare import __version__, config, shipped
from gpushare.cli.app import app

runner = CliRunner()
SHIPPED = shipped.path(shipped.CONFIG)


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"gpushare {__version__}"


def test_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "config" in result.output


def test_unknown_command_is_usage_error():
    result = runner.invoke(app, ["frobnicate"])
    assert result.exit_code == 2
    assert "No such command" in result.output


def test_bad_option_is_usage_error():
    result = runner.invoke(app, ["config", "check", "--no-such-flag"])
    assert result.exit_code == 2


def test_config_check_prints_effective_config():
    result = runner.invoke(app, ["config", "check", str(SHIPPED)])
    assert result.exit_code == 0, result.output
    assert "OK" in result.output
    body = result.output.split("\n", 1)[1]
    assert config.loads(body) == config.Config()


def test_config_check_json(tmp_path: Path):
    f = tmp_path / "g.toml"
    f.write_text('[control]\nperiod = "250ms"\n')
    result = runner.invoke(app, ["config", "check", "--json", str(f)])
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["control"]["period"] == "250ms"
    assert data["paths"]["socket"] == "/run/gpushare/gpushare.sock"


def test_config_check_reports_error_and_exits_2(tmp_path: Path):
    f = tmp_path / "g.toml"
    f.write_text("[control]\nperiod = 'soon'\n")
    result = runner.invoke(app, ["config", "check", str(f)])
    assert result.exit_code == 2
    assert f"{f}: control.period: expected a duration" in result.output


def test_config_check_uses_env_default(tmp_path: Path, monkeypatch):
    f = tmp_path / "g.toml"
    f.write_text("[probe]\nenabled = false\n")
    monkeypatch.setenv("GPUSHARE_CONFIG", str(f))
    result = runner.invoke(app, ["config", "check"])
    assert result.exit_code == 0
    assert "enabled = false" in result.output


def test_python_dash_m_works_without_gpu():
    proc = subprocess.run(
        [sys.executable, "-m", "gpushare", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout


def test_import_touches_no_gpu_library():
    # cuda-bindings 12.x installs a .pth file that imports the empty `cuda` namespace package in
    # every interpreter of the environment, gpushare or not: that module loads nothing. Its
    # submodules (the bindings, pathfinder) and the libraries themselves must stay unloaded.
    code = (
        "import sys, gpushare, gpushare.cli.app; "
        "print([m for m in sys.modules if m.startswith(('pynvml', 'cuda.'))]); "
        "print(getattr(sys.modules.get('cuda'), '__file__', None)); "
        "print([l for l in open('/proc/self/maps') if 'libcuda' in l or 'libnvrtc' in l or 'nvidia-ml' in l])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split("\n")[:3] == ["[]", "None", "[]"], proc.stdout + proc.stderr
