"""The repository works on its own: a copy with nothing beside it, and the wheel in a fresh venv.

A user who clones the repository has no data folder beside it, and `pip install gpushare` has
nothing but the wheel: the simulator must find its profiles, traces and scenarios inside the
package. Both tests run the real CLI in a child process, so nothing of this process's state leaks in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NETWORK_ERRORS = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeoutError",
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUSHARE_", "PYTHON", "VIRTUAL_ENV"))
    }
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's files (tracked, and new ones git does not ignore) copied with nothing beside."""
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: which files belong to the repository is unknown")
    names = subprocess.run(
        [git, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    root = tmp_path_factory.mktemp("alone") / "gpushare"
    for raw in names:
        if not raw:
            continue
        src = REPO / os.fsdecode(raw)
        if src.is_file():  # a file deleted in the working tree is still listed as tracked
            dst = root / os.fsdecode(raw)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    assert not (root.parent / "shared").exists()
    return root


def _run(
    argv: list[str | Path], cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_copy_of_the_repository_alone_runs_scenarios(alone: Path, tmp_path: Path) -> None:
    env = _clean_env(PYTHONPATH=str(alone))
    where = _run(
        [
            sys.executable,
            "-c",
            "import gpushare; from gpushare.sim import data;"
            "print(gpushare.__file__); print(data.resolve('orion-v100-kernels/bert_2_fwd.csv'))",
        ],
        alone,
        env,
    )
    assert where.returncode == 0, where.stderr
    module, profile = where.stdout.split()
    assert Path(module).is_relative_to(alone) and Path(profile).is_relative_to(alone)
    # A shipped scenario by name, and a scenario file by path that replays a trace.
    done = _run(
        [
            sys.executable,
            "-m",
            "gpushare",
            "sim",
            "pairs/bert_2_fwd+resnet50_32_fb1",
            alone / "gpushare" / "scenarios" / "azure-bursty.toml",
            "--policy",
            "gpushare",
            "--duration",
            "3",
            "--no-progress",
            "--out",
            tmp_path,
        ],
        alone,
        env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "pair-bert_2_fwd+resnet50_32_fb1.json").is_file()
    assert (tmp_path / "azure-bursty.json").is_file()


def test_the_wheel_installed_in_a_fresh_venv_runs_a_shipped_scenario(
    alone: Path, tmp_path: Path
) -> None:
    wheel = _build_wheel(alone, tmp_path)
    target = _install_in_a_fresh_venv(wheel, tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    ran = _run(
        [
            target / "bin" / "gpushare",
            "sim",
            "demo",
            "--policy",
            "gpushare",
            "--duration",
            "3",
            "--no-progress",
            "--out",
            outside / "out",
        ],
        outside,
        _clean_env(),
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert (outside / "out" / "demo.json").is_file()
    listed = _run([target / "bin" / "gpushare", "sim", "--list"], outside, _clean_env())
    assert "pairs/resnet50_4_fwd+resnet50_32_fb1" in listed.stdout
    where = _run(
        [target / "bin" / "python", "-c", "import gpushare; print(gpushare.__file__)"],
        outside,
        _clean_env(),
    )
    assert Path(where.stdout.strip()).is_relative_to(target)
    _has_the_probe_dependencies_and_nothing_more(target, outside)
    if shutil.which("cc") is not None:
        # What `gpushare install` does with it: compile the shipped source on the host.
        lib = tmp_path / "libgpushare_inflight.so"
        made = _run(
            [target / "bin" / "python", "-m", "gpushare.native.build", "--strict", lib],
            outside,
            _clean_env(),
        )
        assert made.returncode == 0, made.stdout + made.stderr
        assert lib.is_file()
    _install_dry_run_needs_no_systemd(target, tmp_path, outside)


def _build_wheel(alone: Path, tmp_path: Path) -> Path:
    """Builds the clone's wheel under ``tmp_path``; checks it is pure Python with the host files."""
    wheels = tmp_path / "wheels"
    built = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "-q",
            "-w",
            wheels,
            alone,
        ],
        tmp_path,
        _clean_env(),
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("gpushare-*.whl")
    # A py3-none-any wheel carries the in-flight bound's source, never a compiled library.
    names = zipfile.ZipFile(wheel).namelist()
    assert "gpushare/native/inflight.c" in names
    assert not [n for n in names if n.endswith(".so")]
    # The host files at the repository's top travel in the wheel (gpushare/shipped.py).
    assert "gpushare/_shipped/systemd/gpushare.service" in names
    assert "gpushare/_shipped/etc/gpushare/gpushare.toml" in names
    return wheel


def _install_in_a_fresh_venv(wheel: Path, tmp_path: Path) -> Path:
    """Installs ``wheel`` in a new venv under ``tmp_path`` (skips where no venv or PyPI); its path."""
    target = tmp_path / "venv"
    try:
        venv.create(target, with_pip=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"this Python cannot create a virtual environment with pip: {exc}")
    installed = _run(
        [target / "bin" / "python", "-m", "pip", "install", "-q", wheel], tmp_path, _clean_env()
    )
    if installed.returncode != 0 and any(e in installed.stderr for e in NETWORK_ERRORS):
        pytest.skip("PyPI is not reachable: the wheel's dependencies cannot be installed")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return target


def _install_dry_run_needs_no_systemd(target: Path, tmp_path: Path, outside: Path) -> None:
    """``gpushare install --dry-run`` from the venv ``target`` would write the host files."""
    # The files `gpushare install` writes travel in the wheel too, and a dry run needs no
    # systemd on the host (issue 28.6: no --no-systemd here).
    root = tmp_path / "root"
    root.mkdir()
    dry = _run(
        [target / "bin" / "gpushare", "install", "--root", root, "--dry-run"],
        outside,
        _clean_env(),
    )
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "would create  /etc/gpushare/gpushare.toml" in dry.stdout
    assert "would create  /etc/systemd/system/gpushare.service" in dry.stdout
    assert "would create  /usr/local/share/man/man8/gpushare.8" in dry.stdout


def _has_the_probe_dependencies_and_nothing_more(target: Path, cwd: Path) -> None:
    """CUDA 12 bindings and the NVRTC wheel that compiles the probe; no cuda-core, no numpy."""
    listed = _run(
        [target / "bin" / "python", "-m", "pip", "list", "--format=freeze"], cwd, _clean_env()
    )
    dists = {line.split("==")[0].lower() for line in listed.stdout.splitlines()}
    assert {"cuda-bindings", "nvidia-cuda-nvrtc-cu12"} <= dists, dists
    assert not dists & {"numpy", "cuda-core", "cuda-python"}, dists
    # The wheel's NVRTC is found where pip put it: the probe kernel compiles, with no GPU.
    check = _run(
        [target / "bin" / "python", "-c", "from gpushare.node import probe_host;"
         "c = probe_host.nvrtc_check(); print(c.ok, c.detail)"],
        cwd,
        _clean_env(),
    )  # fmt: skip
    assert check.stdout.startswith("True NVRTC 12."), check.stdout + check.stderr
