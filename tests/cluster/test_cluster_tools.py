"""scripts/get-slurm.sh: idempotent, and it says what it did."""

import shutil
import subprocess

import pytest

from gpushare.paths import repo_root

BASH = shutil.which("bash") or "/bin/bash"
SCRIPT = repo_root() / "scripts" / "get-slurm.sh"


def test_a_second_run_has_nothing_to_do():
    first = subprocess.run(
        [BASH, str(SCRIPT)], capture_output=True, text=True, timeout=600, check=False
    )
    if first.returncode != 0 and "not root" in first.stderr:
        pytest.skip(first.stderr.strip())
    assert first.returncode == 0, first.stderr
    again = subprocess.run(
        [BASH, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False
    )
    assert again.returncode == 0
    assert (
        "slurmctld, slurmd, slurm-client, munge, slurmdbd and mariadb-server are installed; nothing to do"
        in again.stderr
    )
