"""The shallow-queue interposer: where it is and the environment it reads.

``libgpushare_inflight.so`` (built from ``inflight.c`` next to this module by
``scripts/build-native.sh``, ``make native``) is an ``LD_PRELOAD`` library for offline clients.
It bounds the number of CUDA kernel launches a process has issued and not yet completed to
``GPUSHARE_MAX_INFLIGHT`` without synchronising every launch, so a cgroup freeze stops the
client's GPU work within that many kernels while its CPU still prepares the next launch during
the current kernel (``CUDA_LAUNCH_BLOCKING=1`` gives the same bound of 1 but serialises the two).

The daemon launches a shallow-queue offline client with ``LD_PRELOAD=<library_path()>``
(prepended to an existing ``LD_PRELOAD`` with ``:``) and ``GPUSHARE_MAX_INFLIGHT=<k>``. This
module imports nothing from CUDA: the library is C and talks to the driver itself.
"""

from __future__ import annotations

import stat
from pathlib import Path

LIBRARY_NAME = "libgpushare_inflight.so"
"""File name of the built interposer (gitignored; shipped in wheels when built)."""

INFLIGHT_ENV = "GPUSHARE_MAX_INFLIGHT"
"""Integer >= 1: the most kernel launches in flight per process. Missing or invalid: no bound."""

STATS_ENV = "GPUSHARE_INFLIGHT_STATS"
"""A path: at exit each process that launched a kernel appends one JSON line there (``pid``,
``launches``, ``waits``, ``give_ups``, ``graph_launches``, ``max_inflight``, ``bound``,
``captured_passthrough``, ``passthrough_reason``: null while the bound held to the end, else why it
was off). Only a regular file, created 0600, never through a symbolic link; put it in a directory
only its owner can write. A process that ends with ``_exit`` (Python's fork children) writes none."""

WAIT_LIMIT_ENV = "GPUSHARE_INFLIGHT_WAIT_LIMIT_MS"
"""Optional, default 5000: after waiting this long (awake) with every slot pending, that one launch
goes through unbounded (a give-up, counted in the stats) and the bound is back as soon as a launch
in flight completes, so a kernel that waits on a later launch cannot hang the job."""

CONTROL_ENV = "GPUSHARE_INFLIGHT_CONTROL"
"""Optional path to a regular file (not a symbolic link) holding the bound as a 4-byte
little-endian int at offset 0 (0 = unbounded), mapped read-only and read at every launch, so the
bound changes without a restart; it overrides :data:`INFLIGHT_ENV`. Rewrite the 4 bytes in place
(``os.pwrite`` at 0), never truncate the file: a client reading past the end of its mapping dies
of SIGBUS."""


def library_path(configured: Path | None = None) -> Path:
    """The interposer clients preload.

    ``configured`` is ``[paths] inflight_library`` where set; else the library that
    ``scripts/build-native.sh`` puts next to this module.
    """
    return configured if configured is not None else Path(__file__).resolve().parent / LIBRARY_NAME


def built() -> bool:
    """Whether the interposer has been built (``make native``); without it shallow = blocking."""
    return library_path().is_file()


LIBRARY_ROLE = "the in-flight library"
"""How :mod:`gpushare.trust` names the library in its lines and its refusal counter."""


def unusable_reason(lib: Path | None = None) -> str | None:
    """Why clients could not preload the interposer (``None``: they can).

    :func:`unreadable_reason`, else :func:`untrusted_reason`. The daemon asks at start and again
    at every launch, since a file that passed at start can be replaced later.
    """
    lib = lib if lib is not None else library_path()
    return unreadable_reason(lib) or untrusted_reason(lib)


def untrusted_reason(lib: Path) -> str | None:
    """Why the interposer may not be trusted (:mod:`gpushare.trust`); ``None``: it may.

    It runs inside every shallow client, root's included, so a library, or a directory above it,
    that a user other than root can change would run that user's code with another user's rights.
    """
    # Imported here: ``python3 -m gpushare.native.build`` runs this package without the daemon's
    # dependencies (scripts/build-native.sh uses the system Python).
    from gpushare import trust

    return trust.refusal(lib, what=LIBRARY_ROLE)


def unreadable_reason(lib: Path) -> str | None:
    """Why some users' jobs could not load the interposer; ``None``: every user's can.

    Not built, or not readable by every user: a client runs as the user who submitted it, and the
    dynamic loader of a process that cannot open an ``LD_PRELOAD`` entry skips it with one line
    on stderr, so that job would run unbounded. A clone under a private home directory is the
    usual case.
    """
    if not lib.is_file():
        return f"{lib} is not built: `sudo gpushare install` builds it (needs a C compiler)"
    for path in (lib, *lib.parents):
        try:
            mode = path.stat().st_mode
        except OSError as exc:
            return f"{path}: {exc.strerror or exc}"
        if path == lib and not mode & stat.S_IROTH:
            return (
                f"{lib} is not readable by other users, whose jobs could not preload it (chmod o+r)"
            )
        if path != lib and not mode & stat.S_IXOTH:
            return (
                f"{path} is not searchable by other users, whose jobs could not preload {lib.name} "
                f"(chmod o+x {path}, or install gpushare where every user can read it)"
            )
    return None
