"""scripts/gpu-validate.sh on a machine without a GPU: it runs up to its first GPU call and stops there.

The installs are skipped (``GPU_VALIDATE_SKIP_INSTALL=1`` with this interpreter as the Python to
use) so the test takes seconds: the script's install steps (a venv, the wheel, torch from PyPI)
are for the lent GPU machine. What runs is real: the log and JSON plumbing, ``gpushare doctor``
(it needs no GPU), and the GPU call, ``nvidia-smi``, which must fail with one clear line, leave
exactly one log and one JSON in the output directory, and run nothing GPU-related after it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.paths import repo_root

SCRIPT = repo_root() / "scripts" / "gpu-validate.sh"
LOADS = repo_root() / "scripts" / "gpu-validate-loads.py"


def _run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_VALIDATE_")}
    full.update(env)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=full, cwd=tmp_path, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


def test_without_a_gpu_it_stops_at_the_first_gpu_call(tmp_path: Path) -> None:
    if shutil.which("nvidia-smi") is not None:
        pytest.skip("this machine has nvidia-smi: the script would go on to the GPU checks")
    out = tmp_path / "out"
    done = _run(
        [str(out)],
        tmp_path,
        GPU_VALIDATE_SKIP_INSTALL="1",
        GPU_VALIDATE_PYTHON=sys.executable,
        GPU_VALIDATE_WORK=str(tmp_path / "work"),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    message = (
        "gpu-validate: gpu: fail: no usable NVIDIA GPU: nvidia-smi not found. This script runs on "
        "a GPU host (docs/gpu-validation.md); nothing GPU-related ran."
    )
    assert message in done.stdout.splitlines()
    assert sorted(p.name for p in out.iterdir()) == ["gpu-validate.json", "gpu-validate.log"]
    assert message in (out / "gpu-validate.log").read_text()
    result = json.loads((out / "gpu-validate.json").read_text())
    assert result["stopped_at"] == "gpu"
    assert [(s["step"], s["status"]) for s in result["steps"]][::2] == [
        ("install", "skipped"),
        ("gpu", "fail"),
    ]
    assert result["steps"][1]["step"] == "doctor"
    # The doctor ran before the GPU call, and its CUDA lines are in the JSON.
    doctor = result["steps"][1]["result"]  # doctor --json, versioned: {schema_version, ok, checks}
    lines = {line["name"]: line for line in doctor["checks"]}
    assert lines["CUDA bindings"]["detail"].startswith("cuda-bindings 12.")
    assert lines["NVRTC"]["status"] == "OK"
    assert set(result["calibration"]["inference_p99_ms"]) == {
        "alone", "timeslice", "mps", "mps_priority", "gpushare",
    }  # fmt: skip


def test_usage_without_an_output_directory(tmp_path: Path) -> None:
    done = _run([], tmp_path)
    assert (done.returncode, done.stderr) == (64, "usage: scripts/gpu-validate.sh OUTDIR\n")


def test_the_workloads_say_when_torch_is_missing(tmp_path: Path) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch is installed here: the workloads would try to use a GPU")
    done = subprocess.run(
        [sys.executable, str(LOADS), "infer", "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3
    assert done.stderr.startswith("gpu-validate-loads: torch/torchvision not installed")
    assert len(done.stderr.splitlines()) == 1
