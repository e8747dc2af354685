"""The shipped unit file: required settings, and systemd's own verifier where it is installed."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.paths import repo_root

UNIT = repo_root() / "gpushare" / "host_files" / "gpushare.service"


def _settings(text: str) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = {}
            continue
        key, _, value = line.partition("=")
        sections[current].setdefault(key, []).append(value)
    return sections


def test_unit_has_the_settings_the_design_needs():
    s = _settings(UNIT.read_text())
    svc = s["Service"]
    assert svc["Type"] == ["notify"]
    assert svc["ExecStart"][0].split()[1] == "daemon"  # foreground daemon command
    assert "-HUP" in svc["ExecReload"][0]
    assert svc["Restart"] == ["on-failure"]
    assert "StartLimitBurst" in s["Unit"]
    assert "WatchdogSec" in svc
    assert svc["RuntimeDirectory"] == ["gpushare"]
    assert svc["RuntimeDirectoryMode"] == ["0755"]
    assert svc["RuntimeDirectoryPreserve"] == ["yes"]
    assert svc["StateDirectory"] == ["gpushare"]
    assert svc["StateDirectoryMode"] == ["0711"]  # the registry's WAL is never world-readable
    assert svc["ConfigurationDirectory"] == ["gpushare"]
    assert svc["Delegate"] == ["yes"]
    assert svc["KillMode"] == ["process"]
    assert s["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (apt-get install systemd)",
)
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path):
    # verify insists that ExecStart= names an existing executable: point it at this interpreter.
    text = UNIT.read_text().replace(
        "/usr/bin/gpushare daemon", f"{sys.executable} -m gpushare daemon"
    )
    unit = tmp_path / "gpushare.service"
    unit.write_text(text)
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    complaints = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if "gpushare.service" in line or "Unknown" in line
    ]
    assert proc.returncode == 0, proc.stderr
    assert complaints == []


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_verify_catches_a_misspelt_key(tmp_path: Path):
    # Guards the test above: a typo must show up as a complaint we would see.
    text = UNIT.read_text().replace(
        "/usr/bin/gpushare daemon", f"{sys.executable} -m gpushare daemon"
    )
    unit = tmp_path / "gpushare.service"
    unit.write_text(text.replace("Delegate=yes", "Delegat=yes"))
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert "Unknown key" in proc.stdout + proc.stderr
