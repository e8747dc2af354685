"""Faults injected for real: a small tmpfs to fill, a read-only remount, a SQLite lock held by another process."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

FILLER = "filler"


def tmpfs_skip_reason() -> str | None:
    """Why a tmpfs cannot be mounted here, or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    with tempfile.TemporaryDirectory(prefix="gs-probe-") as d:
        out = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d], capture_output=True, text=True
        )
        if out.returncode != 0:
            return f"cannot mount a tmpfs: {out.stderr.strip()}"
        subprocess.run(["umount", d], check=True)
    return None


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "2m") -> Iterator[Path]:
    """Mount a tmpfs of ``size`` at ``path`` (created) for the block; unmounted after, lazily if busy."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                   check=True)  # fmt: skip
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path) -> int:
    """Fill the file system of ``directory`` to the last byte; returns the bytes written."""
    written = 0
    chunk = b"\0" * 4096
    fd = os.open(directory / FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (4096, 512, 1):
            try:
                while True:
                    written += os.write(fd, chunk[:size])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)
    assert os.statvfs(directory).f_bavail == 0
    return written


def free(directory: Path) -> None:
    """Undo :func:`fill`."""
    (directory / FILLER).unlink()


def remount(path: Path, mode: str) -> None:
    """Remount the tmpfs at ``path`` ``ro`` or ``rw``."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


_LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()
conn.execute("ROLLBACK")
"""


@contextlib.contextmanager
def sqlite_locked(db: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holds ``BEGIN EXCLUSIVE`` on ``db`` for the block (close its stdin to end it)."""
    proc = subprocess.Popen([sys.executable, "-c", _LOCKER, str(db)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        release_lock(proc)


def release_lock(proc: subprocess.Popen[str]) -> None:
    """End the locking process (its lock goes with it)."""
    if proc.poll() is None:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
