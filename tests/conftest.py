"""Fixtures shared by the whole suite."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from bench.support.helpers import MPS_MISSING, TRUSTED_MPS_COPY, find_mps_control
from bench.support.trusted import SKIP_REASON, trusted_base, trusted_dir

# The unprivileged accounts of the abuse suite (`accounts`), available to every test.
pytest_plugins = ["bench.support.accounts"]


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
    """A temporary directory the daemon may trust (bench/support/trusted.py), removed after."""
    if trusted_base() is None:
        pytest.skip(SKIP_REASON)
    with trusted_dir() as path:
        yield path


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove the trusted copy of the MPS binaries, if the session made one."""
    base = trusted_base()
    if base is not None:
        shutil.rmtree(base / TRUSTED_MPS_COPY, ignore_errors=True)
