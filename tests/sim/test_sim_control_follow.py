"""The simulated twin's control-file reading: only the daemon's own file is followed (issue 32).

The path comes from the job's environment, which its owner writes; the daemon reading it is root.
Real files in a root-owned directory: the daemon's file is followed and its rewrites reach the
twin; another path, a link, a FIFO or a file of another user are not read.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.trusted import make_trusted_dir
from gpushare import native
from gpushare.daemon.inflight_control import ControlFiles, control_path
from gpushare.sim.control_follow import ControlFollower

GPU = "GPU-sim-0000"


@pytest.fixture
def directory() -> Iterator[Path]:
    base = make_trusted_dir("gscf-")
    yield base / "inflight"
    shutil.rmtree(base, ignore_errors=True)


def _env(path: Path | str) -> dict[str, str]:
    return {"LD_PRELOAD": f"/usr/lib/{native.LIBRARY_NAME}", native.CONTROL_ENV: str(path)}


def test_the_daemons_file_is_followed_and_its_rewrites_reach_the_follower(directory: Path) -> None:
    files = ControlFiles(directory)
    path = files.path(GPU)
    follower = ControlFollower(directory)
    try:
        assert follower.follow("c1", GPU, _env(path)) == 0
        assert follower.changed() == []
        files.write(GPU, 4)
        assert follower.changed() == [("c1", 4)]
        assert follower.changed() == []
        files.write(GPU, 0)
        assert follower.changed() == [("c1", 0)]
        # Without the library preloaded nothing reads the file, in the simulator either.
        assert follower.follow("c2", GPU, {native.CONTROL_ENV: path}) is None
        follower.forget("c1")
        assert not follower.following
    finally:
        follower.close()
        files.close()


def test_a_path_the_jobs_owner_chose_is_never_read(directory: Path, tmp_path: Path) -> None:
    files = ControlFiles(directory)
    files.path(GPU)
    follower = ControlFollower(directory)
    try:
        # Another file: a secret of root's, or the file of another GPU.
        secret = tmp_path / "secret"
        secret.write_bytes(struct.pack("<i", 1234))
        assert follower.follow("c1", GPU, _env(secret)) is None
        assert follower.follow("c1", GPU, _env(files.path("GPU-other"))) is None
        # The daemon's path, but a FIFO put in its place: not opened for reading (no hang).
        fifo_dir = tmp_path / "inflight"
        fifo_dir.mkdir()
        os.mkfifo(control_path(fifo_dir, GPU))
        assert (
            ControlFollower(fifo_dir).follow("c1", GPU, _env(control_path(fifo_dir, GPU))) is None
        )
        # A link in its place is not followed.
        link_dir = tmp_path / "links"
        link_dir.mkdir()
        control_path(link_dir, GPU).symlink_to(secret)
        assert (
            ControlFollower(link_dir).follow("c1", GPU, _env(control_path(link_dir, GPU))) is None
        )
        # A file of another user.
        other_dir = tmp_path / "other"
        other_dir.mkdir()
        theirs = control_path(other_dir, GPU)
        theirs.write_bytes(struct.pack("<i", 7))
        os.chown(theirs, 65534, 65534)
        assert ControlFollower(other_dir).follow("c1", GPU, _env(theirs)) is None
        assert not follower.following
    finally:
        follower.close()
        files.close()
