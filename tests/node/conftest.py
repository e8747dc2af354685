"""Fixtures the node tests of several modules share.

Real cgroups (``cg_base``, ``pauser``) and child processes (``children``, ``started``) for the
``test_cgroups_*``, ``test_signal_pauser`` and ``test_procs_*`` modules. A module's own fixture of
the same name wins over these (``test_process_facts.py`` has its own ``started``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.cgroup_helpers import remove_tree, unique_base
from gpushare.node.cgroups.pauser import CgroupPauser
from tests.support.cgroup_marks import CGROUP_SKIP
from tests.support.processes import Children, Procs

# Real cgroups and processes ------------------------------------------------------------------


@pytest.fixture
def cg_base() -> Iterator[Path]:
    """A fresh directory beside this process's cgroup; killed and removed at teardown."""
    if CGROUP_SKIP is not None:
        pytest.skip(CGROUP_SKIP)
    base = unique_base("gpushare-test")
    yield base
    remove_tree(base)


@pytest.fixture
def pauser(cg_base: Path) -> CgroupPauser:
    # pids() read afresh on every call: these tests look at what the cgroup holds at each moment
    # (a transient subshell must be gone). Tracking pids on change has tests of its own
    # (test_cgroups_pids.py).
    return CgroupPauser(cg_base, freeze_timeout_s=2.0, pids_rescan_s=0.0)


@pytest.fixture
def children() -> Iterator[Children]:
    kids = Children()
    yield kids
    kids.cleanup()


@pytest.fixture
def started() -> Iterator[Procs]:
    kids = Procs()
    yield kids
    kids.cleanup()
