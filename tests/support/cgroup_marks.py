"""Whether this machine can run the real cgroup v2 tests: the reason, and the mark that skips."""

from __future__ import annotations

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason

CGROUP_SKIP = cgroup_skip_reason()
needs_cgroup = pytest.mark.skipif(CGROUP_SKIP is not None, reason=CGROUP_SKIP or "")
