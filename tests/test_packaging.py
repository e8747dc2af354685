"""The wheel: the host files from the repository's top, once, and the licence in PEP 639 form.

The repository keeps ``systemd/``, ``etc/gpushare/`` and ``man/`` at its top and nowhere else
(gpushare/shipped.py); the build copies them into the wheel. One wheel is built from a copy of
the tracked files, offline, with setuptools' own backend (no pip, no network).
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gpushare import shipped

REPO = Path(__file__).resolve().parents[1]
_BUILD = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"


def _copy_tracked(dest: Path) -> None:
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    for raw in filter(None, names):
        src = REPO / os.fsdecode(raw)
        if src.is_file():
            (dest / os.fsdecode(raw)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(raw))


def _build(src: Path, out: Path) -> tuple[Path, str]:
    out.mkdir()
    done = subprocess.run([sys.executable, "-c", _BUILD, str(out)], cwd=src, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1], done.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: which files belong to the repository is unknown")
    src = tmp_path_factory.mktemp("src")
    _copy_tracked(src)
    return _build(src, tmp_path_factory.mktemp("wheel") / "out")


def test_the_wheel_carries_each_host_file_as_the_repository_has_it(built: tuple[Path, str]):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for name in shipped.ALL:
            inside = f"gpushare/{shipped.WHEEL_DIR}/{name}"
            assert inside in names
            assert z.read(inside) == (REPO / name).read_bytes()
    assert not [n for n in names if n.startswith("gpushare/host_files/")]


def test_the_repository_keeps_one_copy_of_each_host_file():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.splitlines()  # fmt: skip
    for name in shipped.ALL:
        base = Path(name).name
        assert [t for t in tracked if Path(t).name == base] == [name]
    # From a clone the package finds the top-level file itself.
    assert shipped.path(shipped.UNIT) == REPO / "systemd" / "gpushare.service"


def test_the_licence_is_an_spdx_expression_with_its_file_and_the_build_warns_nothing(
    built: tuple[Path, str],
):
    wheel, stderr = built
    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(z.read(meta_name))
        licence = meta_name.replace("METADATA", "licenses/LICENSE")
        assert "Apache License" in z.read(licence).decode()
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta["License"] is None  # the deprecated free-text field
    assert "deprecat" not in stderr.lower(), stderr


def test_the_old_licence_table_would_warn(tmp_path: Path):
    # Guards the test above: the form issue 28 found warns at build time with this setuptools.
    src = tmp_path / "src"
    _copy_tracked(src)
    pyproject = src / "pyproject.toml"
    text = pyproject.read_text().replace('license = "Apache-2.0"\nlicense-files = ["LICENSE"]\n',
                                         'license = { text = "Apache-2.0" }\n')  # fmt: skip
    assert text != pyproject.read_text()
    pyproject.write_text(text)
    _, stderr = _build(src, tmp_path / "out")
    assert "deprecat" in stderr.lower()
