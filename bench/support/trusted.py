"""Temporary directories the daemon may trust (gpushare.trust): root's, in a root-only chain.

``/tmp`` (sticky, writable by all) fails the rule, so a test that hands the daemon a file it must
trust (a config it reloads, an MPS front end it runs, a library it preloads) makes the file here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpushare.trust import TrustCheck

# /run is a root-only tmpfs on systemd hosts and in most containers; /var/lib and /opt are root's
# on any Debian-like image. Short first: Unix socket paths are limited to 108 bytes.
_BASES = ("/run", "/var/lib", "/opt")


def trusted_base() -> Path | None:
    """The first candidate this process may write and the daemon would trust; None if none."""
    if os.geteuid() != 0:
        return None
    check = TrustCheck()  # its own, so these look-ups do not count as the daemon's refusals
    for base in _BASES:
        if os.access(base, os.W_OK) and check.refusal(base, what="test base") is None:
            return Path(base)
    return None


SKIP_REASON = "needs root and a root-only writable directory (/run, /var/lib or /opt)"


def make_trusted_dir(prefix: str) -> Path:
    """A fresh root-owned 0755 directory below a trusted base; the caller removes it.

    Raises:
        RuntimeError: no base qualifies (not root, or every candidate is writable by others).
    """
    base = trusted_base()
    if base is None:
        raise RuntimeError(SKIP_REASON)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    path.chmod(0o755)
    return path


@contextmanager
def trusted_dir(prefix: str = "gs-trust-") -> Iterator[Path]:
    """:func:`make_trusted_dir`, removed on exit."""
    path = make_trusted_dir(prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
