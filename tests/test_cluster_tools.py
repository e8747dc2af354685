"""scripts/get-slurm.sh and scripts/get-podman.sh: idempotent, and they say what they did."""

import shutil
import subprocess

import pytest

from gpushare.paths import repo_root

BASH = shutil.which("bash") or "/bin/bash"


@pytest.mark.parametrize(
    ("script", "tools"), [("get-slurm.sh", "slurmctld"), ("get-podman.sh", "podman")]
)
def test_a_second_run_has_nothing_to_do(script, tools):
    first = subprocess.run([BASH, str(repo_root() / "scripts" / script)], capture_output=True,
                           text=True, timeout=600, check=False)  # fmt: skip
    if first.returncode != 0 and "not root" in first.stderr:
        pytest.skip(first.stderr.strip())
    assert first.returncode == 0, first.stderr
    again = subprocess.run([BASH, str(repo_root() / "scripts" / script)], capture_output=True,
                           text=True, timeout=60, check=False)  # fmt: skip
    assert again.returncode == 0
    assert "nothing to do" in again.stderr
    assert tools in again.stderr
