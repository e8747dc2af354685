"""The host files gpushare ships, found from a clone and from the installed wheel alike.

The repository keeps each file once, at the place an operator looks for it: the unit, sysusers.d
and tmpfiles.d files in ``systemd/``, the documented default config in ``etc/gpushare/``, the man
pages in ``man/``. The build (``setup.py``) copies them into the wheel under
``gpushare/_shipped/`` with the same relative paths, so one name finds a file in both places:
the wheel's copy first (an installed package), else the clone's (a checkout or an editable
install, where the package directory has no ``_shipped/``).
"""

from __future__ import annotations

from pathlib import Path

#: The shipped files, by their path relative to the repository root (and to ``_shipped/``).
UNIT = "systemd/gpushare.service"
SYSUSERS = "systemd/gpushare.sysusers"
TMPFILES = "systemd/gpushare.tmpfiles"
CONFIG = "etc/gpushare/gpushare.toml"
MAN_PAGES = ("man/man8/gpushare.8", "man/man5/gpushare.toml.5")
ALL = (UNIT, SYSUSERS, TMPFILES, CONFIG, *MAN_PAGES)

_PACKAGE = Path(__file__).resolve().parent
WHEEL_DIR = "_shipped"


class MissingFileError(Exception):
    """A shipped file is in neither the package nor the checkout: the installation is broken."""


def path(name: str) -> Path:
    """Where the shipped file ``name`` (one of :data:`ALL`) is on this machine.

    Raises:
        MissingFileError: it is in neither place; the message names the fix.
    """
    for candidate in (_PACKAGE / WHEEL_DIR / name, _PACKAGE.parent / name):
        if candidate.is_file():
            return candidate
    raise MissingFileError(
        f"{name} is missing from this gpushare installation: reinstall it "
        "(pip install --force-reinstall gpushare)"
    )


def missing() -> list[str]:
    """The shipped files this installation lacks (none, unless it is broken)."""
    found = []
    for name in ALL:
        try:
            path(name)
        except MissingFileError:
            found.append(name)
    return found


def text(name: str) -> str:
    """The text of the shipped file ``name``.

    Raises:
        MissingFileError: see :func:`path`.
    """
    return path(name).read_text(encoding="utf-8")
