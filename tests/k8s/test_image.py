"""The OCI image: the Containerfile builds from the wheel, and gpushare runs in it (opt-in).

``GPUSHARE_TEST_IMAGE=1`` runs it (tests/README.md): it takes minutes (debootstrap, a vfs build),
so it is not part of the default run and not CI coverage. Everything is real: a Debian bookworm
base made by debootstrap and imported into podman (no registry is reachable here), the wheel built
from this checkout and its dependencies as wheels, ``podman build --network none`` of the
Containerfile, and ``podman run`` of the image.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench.support.daemon_helpers import REPO
from gpushare import __version__

pytestmark = pytest.mark.skipif(
    os.environ.get("GPUSHARE_TEST_IMAGE") != "1",
    reason="opt-in (minutes): GPUSHARE_TEST_IMAGE=1 builds and runs the image (tests/README.md)",
)
CACHE = Path(os.environ.get("GPUSHARE_TEST_IMAGE_CACHE", "/var/tmp/gpushare-image-test"))


def _run(argv: list[str], timeout_s: float, **kw) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout_s, check=False, **kw
    )
    assert done.returncode == 0, f"{argv[:4]}: {done.stderr[-3000:]}"
    return done


def _base_rootfs() -> Path:
    rootfs = CACHE / "rootfs"
    if not (rootfs / "usr" / "bin" / "python3").exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        _run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv", "bookworm",
              str(rootfs), "http://deb.debian.org/debian"], 1200)  # fmt: skip
    return rootfs


def test_the_image_builds_from_the_wheel_and_runs_gpushare() -> None:
    missing = [t for t in ("podman", "runc", "debootstrap") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        pytest.skip(
            f"needs root and {', '.join(missing) or 'podman'} (apt-get install podman runc debootstrap)"
        )
    CACHE.mkdir(parents=True, exist_ok=True)
    rootfs = _base_rootfs()
    work = Path(tempfile.mkdtemp(prefix="gs-image-", dir="/var/tmp"))
    podman = ["podman", "--root", str(work / "storage"), "--runroot", str(work / "run"),
              "--storage-driver", "vfs", "--runtime", "runc", "--cgroup-manager", "cgroupfs",
              "--events-backend", "none"]  # fmt: skip
    try:
        ctx = work / "ctx"
        (ctx / "dist").mkdir(parents=True)
        shutil.copy(REPO / "Containerfile", ctx)
        pip = [sys.executable, "-m", "pip"]
        _run([*pip, "wheel", "-q", "--no-deps", "-w", str(ctx / "dist"), str(REPO)], 300)
        (wheel,) = (ctx / "dist").glob("gpushare-*.whl")
        _run([*pip, "download", "-q", "-d", str(ctx / "dist"), f"{wheel}[kubernetes]",
              "--python-version", "3.11", "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
              "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
              "--platform", "linux_x86_64", "--platform", "any"], 600)  # fmt: skip
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        _run(
            [*podman, "import", "-", "localhost/gpushare-test-base:bookworm"], 300, stdin=tar.stdout
        )
        assert tar.wait(60) == 0
        _run([*podman, "build", "--network", "none", "--pull=never",
              "--build-arg", "BASE=localhost/gpushare-test-base:bookworm",
              "--build-arg", "PIP_OPTS=--no-index --find-links /src/dist",
              "-f", str(ctx / "Containerfile"), "-t", "localhost/gpushare:test", str(ctx)], 1200)  # fmt: skip
        script = (
            "gpushare --version; echo version=$?; gpushare doctor; echo doctor=$?; "
            "gpushare k8s device-plugin --kubelet-dir /nonexistent; echo plugin=$?"
        )
        out = subprocess.run(
            [*podman, "run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024",
             "--ulimit", "nproc=1024:1024", "localhost/gpushare:test", "sh", "-c", script],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        text = out.stdout + out.stderr
        assert out.returncode == 0, text
        assert f"gpushare {__version__}\nversion=0" in text
        # No GPU, driver or MPS binary here: doctor says so and exits 1, and checks the rest.
        assert "doctor=1" in text
        assert "NVML                FAIL" in text
        assert (
            "gpushare package    OK    /opt/gpushare/lib/python3.11/site-packages/gpushare" in text
        )
        assert "NVRTC               OK" in text
        assert "/nonexistent is not a directory" in text and "plugin=2" in text
        assert "Traceback" not in text
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False, timeout=600)
