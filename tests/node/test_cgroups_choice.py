"""Choosing the pauser (gpushare.node.cgroups.choice): the freezer where it works, else signals.

``make_pauser`` and ``freezer_check`` on the real hierarchy and outside it, the configured
``paths.cgroup_base``, and a CgroupPauser refusing a directory that is not a cgroup.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from gpushare.model import PauseMechanism
from gpushare.node.cgroups.choice import freezer_check, make_pauser
from gpushare.node.cgroups.discovery import cgroup2_mount
from gpushare.node.cgroups.pauser import CgroupPauser
from gpushare.node.pauser_base import PauserError
from gpushare.node.signal_pauser import SignalPauser
from tests.support.cgroup_marks import needs_cgroup


@needs_cgroup
def test_make_pauser_picks_cgroup_when_writable(cg_base: Path) -> None:
    choice = make_pauser(cg_base)
    assert choice.pauser.mechanism is PauseMechanism.CGROUP
    assert isinstance(choice.pauser, CgroupPauser)
    assert str(cg_base) in choice.reason
    assert [p for p in cg_base.iterdir() if p.is_dir()] == []  # the probe cgroup is gone


@needs_cgroup
def test_freezer_check_changes_nothing(cg_base: Path, tmp_path: Path) -> None:
    ok, detail = freezer_check(cg_base)
    assert ok, detail
    assert str(cg_base) in detail
    assert not cg_base.exists()  # made for the check, removed again
    ok, detail = freezer_check(tmp_path / "x")
    assert not ok
    assert "not under the cgroup2 mount" in detail


def test_make_pauser_falls_back_outside_cgroupfs(tmp_path: Path) -> None:
    pauser, reason = make_pauser(tmp_path / "clients")
    assert pauser.mechanism is PauseMechanism.SIGNAL
    assert isinstance(pauser, SignalPauser)
    assert "not under the cgroup2 mount" in reason or "no cgroup2" in reason
    assert not (tmp_path / "clients").exists()


def test_make_pauser_falls_back_for_missing_parent() -> None:
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 filesystem is mounted")
    base = mount / f"gpushare-no-such-{uuid.uuid4().hex[:8]}" / "clients"
    pauser, reason = make_pauser(base)
    assert pauser.mechanism is PauseMechanism.SIGNAL
    assert "does not exist" in reason
    assert not base.parent.exists()


def test_cgroup_pauser_refuses_plain_directory(tmp_path: Path) -> None:
    with pytest.raises(PauserError, match="not a cgroup v2 directory"):
        CgroupPauser(tmp_path)


@needs_cgroup
def test_configured_cgroup_base_is_used(cg_base: Path) -> None:
    from gpushare import config

    cfg = config.loads(f'[paths]\ncgroup_base = "{cg_base}"\n')
    assert cfg.paths.cgroup_base == cg_base
    pauser, reason = make_pauser(cfg.paths.cgroup_base)
    assert isinstance(pauser, CgroupPauser)
    assert pauser.base == cg_base
    assert str(cg_base) in reason
