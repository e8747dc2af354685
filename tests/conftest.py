"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from tests.support.helpers import MPS_MISSING, find_mps_control
from tests.support.trusted import SKIP_REASON, trusted_base, trusted_dir


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    # structlog keeps global configuration; each test starts from the defaults.
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture
def mps_control() -> Path:
    """Path of the real MPS control binary, or skip with the reason and the fix."""
    found = find_mps_control()
    if found is None:
        pytest.skip(MPS_MISSING)
    return found


@pytest.fixture
def trusted_tmp() -> Iterator[Path]:
    """A temporary directory the daemon may trust (tests/support/trusted.py), removed after."""
    if trusted_base() is None:
        pytest.skip(SKIP_REASON)
    with trusted_dir() as path:
        yield path
