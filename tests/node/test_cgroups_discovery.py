"""Finding cgroup v2 (gpushare.node.cgroups.discovery): the mount, own cgroup, default base.

Parsing runs on real file formats written to disk; the rest reads this machine's hierarchy: a
daemon moving itself into its leaf (in a child process) and systemd's delegation marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.node.cgroups.discovery import (
    DAEMON_LEAF,
    DEFAULT_SUBTREE,
    cgroup2_mount,
    default_base_dir,
    is_delegated,
    move_self_to_leaf,
    own_cgroup,
)
from gpushare.node.cgroups.pauser import CgroupPauser
from tests.support.cgroup_marks import needs_cgroup
from tests.support.processes import Children

HYBRID_MOUNTS = """\
sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/freezer cgroup rw,relatime,freezer 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""


def test_cgroup2_mount_finds_hybrid_unified(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(HYBRID_MOUNTS)
    assert cgroup2_mount(mounts) == Path("/sys/fs/cgroup/unified")


def test_cgroup2_mount_unescapes_spaces(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("cgroup2 /mnt/my\\040cgroups cgroup2 rw 0 0\n")
    assert cgroup2_mount(mounts) == Path("/mnt/my cgroups")


def test_cgroup2_mount_none_on_v1_only_host(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("cgroup /sys/fs/cgroup/freezer cgroup rw,freezer 0 0\n")
    assert cgroup2_mount(mounts) is None
    assert cgroup2_mount(tmp_path / "missing") is None


def test_own_cgroup_joins_v2_line_to_mount(tmp_path: Path) -> None:
    cg = tmp_path / "cgroup"
    cg.write_text("4:memory:/x\n0::/system.slice/gpushare.service\n")
    assert own_cgroup(Path("/sys/fs/cgroup"), cg) == Path(
        "/sys/fs/cgroup/system.slice/gpushare.service"
    )
    cg.write_text("1:cpu:/\n0::/\n")
    assert own_cgroup(Path("/sys/fs/cgroup/unified"), cg) == Path("/sys/fs/cgroup/unified")
    cg.write_text("1:cpu:/\n")
    assert own_cgroup(Path("/sys/fs/cgroup"), cg) is None


def test_real_mount_matches_proc_mounts() -> None:
    listed = [
        line.split()[1]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[2] == "cgroup2"
    ]
    found = cgroup2_mount()
    if not listed:
        assert found is None
    else:
        assert found == Path(listed[0].replace("\\040", " "))
        assert (found / "cgroup.procs").exists()
        own = own_cgroup(found)
        assert own is not None
        assert str(os.getpid()) in (own / "cgroup.procs").read_text().split()


def test_default_base_dir_layout(tmp_path: Path) -> None:
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 filesystem is mounted")
    own = own_cgroup(mount)
    base = default_base_dir(mount)
    if own == mount:
        assert base == mount / DEFAULT_SUBTREE
    elif own is not None and own.name == DAEMON_LEAF:
        assert base == own.parent
    else:
        assert base == own


@needs_cgroup
def test_move_self_to_leaf_in_subprocess(cg_base: Path, children: Children) -> None:
    # The daemon's situation under Delegate=yes: it starts in the base cgroup itself and must move
    # into a leaf before clients go beside it. Done in a child so the test runner stays put.
    CgroupPauser(cg_base)
    script = (
        "import json, os, sys\n"
        "from pathlib import Path\n"
        "import structlog\n"
        "structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))\n"
        "from gpushare.node.cgroups.discovery import default_base_dir, move_self_to_leaf, own_cgroup\n"
        "base = Path(sys.argv[1])\n"
        "(base / 'cgroup.procs').write_text(str(os.getpid()))\n"
        "before = own_cgroup()\n"
        "in_base_default = default_base_dir()\n"
        "moved = move_self_to_leaf(base)\n"
        "again = move_self_to_leaf(base)\n"
        "print(json.dumps([str(before), str(moved), str(again), str(own_cgroup()),\n"
        "                  str(default_base_dir()), str(in_base_default)]), flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = children.start(
        [sys.executable, "-c", script, str(cg_base)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    before, moved, again, after, default, in_base = json.loads(proc.stdout.readline())
    assert before == str(cg_base)
    assert moved == str(cg_base / "daemon")
    assert again == "None"
    assert after == str(cg_base / "daemon")
    assert default == str(cg_base)  # a daemon in its leaf still puts clients beside it
    assert in_base == str(cg_base)  # a daemon in its own (unit) cgroup puts clients there...
    assert (cg_base / "cgroup.procs").read_text() == ""
    proc.stdin.close()  # type: ignore[union-attr]
    proc.wait(timeout=10)
    # ...and says that systemd did not delegate it (no trusted.delegate marker here).
    assert "cgroup_not_delegated" in proc.stderr.read().decode()


@needs_cgroup
def test_is_delegated_reads_systemds_marker(cg_base: Path) -> None:
    CgroupPauser(cg_base)
    assert not is_delegated(cg_base)
    try:
        os.setxattr(cg_base, "trusted.delegate", b"1")
    except OSError as exc:
        pytest.skip(f"cgroupfs here does not take trusted.* xattrs: {exc}")
    assert is_delegated(cg_base)


@needs_cgroup
def test_move_self_to_leaf_noop_outside_base(cg_base: Path) -> None:
    CgroupPauser(cg_base)
    assert move_self_to_leaf(cg_base) is None
    assert not (cg_base / "daemon").exists()
