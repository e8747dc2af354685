"""Whether a file the root daemon loads, runs, or hands to another user's process may be trusted.

The daemon runs as root and acts for every local user, so a file it executes (the MPS control and
server binaries), preloads into a job (the in-flight library), or reads its orders from (the config
file) must be one that no other user can change. The rule, for the file and every directory above
it, both along the path as written and along the path it resolves to (a symbolic link is followed,
and the directories above its target count too):

- owned by root (uid 0), and
- not writable by its group or by others.

A sticky directory (``/tmp``, mode 1777) fails the rule too: the sticky bit stops another user from
renaming *this* file, but not from creating the name first, before root does, or from swapping a
directory level below that they own. Read and search rights are not this module's concern
(:func:`gpushare.native.unusable_reason` asks whether every user can read the library).

The check runs at every use (each launch, each MPS start and command, each reload), not only at
daemon start: a file that was root's at start can be replaced later by a user who can write a
directory above it. Verdicts are cached by the identity of every path component, ``(st_dev,
st_ino, st_mtime_ns, st_ctime_ns)``: a replaced file or directory changes its inode, a renamed
entry its directory's mtime, and a ``chmod``/``chown`` only the ctime, which is why ctime is in the
key too. So the stat calls run at every use (a few microseconds each) and a refusal is logged once
per state of the files, while each refusal is counted (:func:`refusals`, shown by ``status``).
"""

from __future__ import annotations

import os
import stat
import threading
from collections import Counter
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

ROOT_UID = 0

_CACHE_MAX = 256
"""Distinct paths remembered; the daemon checks a handful, so this only bounds a runaway caller."""

_Key = tuple[tuple[int, int, int, int], ...]


def fix_for(path: Path | str, *, sticky: bool = False) -> str:
    """What makes ``path`` trustworthy (for one component of the chain).

    A shared sticky directory such as ``/tmp`` must stay writable by all, so the file moves instead.
    """
    if sticky:
        return f"move it out of {path}, below directories only root can write (e.g. /usr/local/lib)"
    return f"chown root:root {path} && chmod go-w {path}"


def _chain(path: str) -> list[str]:
    """``path`` (absolute, normalised) and every directory above it, from ``/`` down."""
    out, current = ["/"], ""
    for part in path.split("/"):
        if part:
            current += "/" + part
            out.append(current)
    return out


def _stats(literal: str) -> list[tuple[str, os.stat_result]]:
    """Each component of ``literal``, and where a link is met of its target's chain, with stats.

    Strings and one ``lstat`` per component: the launch path runs this at every launch, and
    ``os.path.realpath`` (several times the cost) is needed only where a component is a link.

    Raises:
        OSError: a component is missing or cannot be read.
    """
    stats = [(c, os.lstat(c)) for c in _chain(literal)]
    if not any(stat.S_ISLNK(st.st_mode) for _, st in stats):
        return stats
    resolved = os.path.realpath(literal, strict=True)
    components = dict.fromkeys([*_chain(literal), *_chain(resolved)])
    return [(c, os.stat(c)) for c in components]


def _problem(component: Path | str, st: os.stat_result) -> tuple[str, str] | None:
    """What is wrong with one component, and the fix; None when it passes."""
    if st.st_uid != ROOT_UID:
        return f"{component} is owned by uid {st.st_uid}, not root", fix_for(component)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = f"{st.st_mode & 0o7777:04o}"
        if st.st_mode & stat.S_ISVTX and stat.S_ISDIR(st.st_mode):
            return (
                f"{component} is a shared sticky directory (mode {mode})",
                fix_for(component, sticky=True),
            )
        return f"{component} is writable by group or others (mode {mode})", fix_for(component)
    return None


def _verdict(what: str, literal: str, stats: list[tuple[str, os.stat_result]]) -> str | None:
    """The refusal line for the first component that fails the rule; None when all pass."""
    for component, st in stats:
        found = _problem(component, st)
        if found is not None:
            problem, fix = found
            return (
                f"{what} {literal} is not trusted: {problem}; a user who can change it could run "
                f"code as root or as another user (fix: {fix})"
            )
    return None


class TrustCheck:
    """The rule of this module with its cache and its refusal counter; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[_Key, str | None]] = {}
        self._refused: Counter[str] = Counter()

    def refusal(self, path: Path | str, *, what: str) -> str | None:
        """Why ``path`` may not be trusted (one line naming the culprit and the fix); None: it may.

        ``what`` names the file's role (``"the in-flight library"``): it labels the line, the log
        and the refusal counter.
        """
        literal = os.path.abspath(path)
        try:
            stats = _stats(literal)
        except OSError as exc:
            self.count(what)
            return f"{what} {literal}: {exc.strerror or exc}"
        key: _Key = tuple((s.st_dev, s.st_ino, s.st_mtime_ns, s.st_ctime_ns) for _, s in stats)
        with self._lock:
            cached = self._cache.get(literal)
        if cached is not None and cached[0] == key:
            why = cached[1]
        else:
            why = _verdict(what, literal, stats)
            if why is not None:
                log.warning("untrusted_file", what=what, path=literal, reason=why)
            with self._lock:
                if len(self._cache) >= _CACHE_MAX:
                    self._cache.clear()
                self._cache[literal] = (key, why)
        if why is not None:
            self.count(what)
        return why

    def count(self, what: str) -> None:
        """Count one refused use of a file of role ``what`` (a refusal found by another walk)."""
        with self._lock:
            self._refused[what] += 1

    def refusals(self) -> dict[str, int]:
        """How many uses were refused, by the file's role, since the process started."""
        with self._lock:
            return dict(self._refused)


CHECK = TrustCheck()
"""The process's one checker: the launcher, the MPS supervisor, reload and ``doctor`` share it."""


def refusal(path: Path | str, *, what: str) -> str | None:
    """:meth:`TrustCheck.refusal` of the process's checker."""
    return CHECK.refusal(path, what=what)


def refusals() -> dict[str, int]:
    """:meth:`TrustCheck.refusals` of the process's checker (``status`` shows it)."""
    return CHECK.refusals()


def tree_refusal(root: Path, *, what: str) -> str | None:
    """:func:`refusal` for ``root`` and for every file and directory below it; None: all pass.

    For an installation (``gpushare doctor``): root runs the package's modules and their cached
    bytecode, and Slurm's Prolog runs its command. Links below ``root`` are not followed.
    """
    why = refusal(root, what=what)
    if why is not None:
        return why
    for top, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = Path(top) / name
            try:
                st = os.lstat(path)
            except OSError:
                continue  # gone meanwhile: nothing left to run
            if stat.S_ISLNK(st.st_mode):
                continue
            found = _problem(path, st)
            if found is not None:
                CHECK.count(what)
                return (
                    f"{what} {root} is not trusted: {found[0]}; a user who can change it could "
                    f"run code as root or as another user (fix: {found[1]})"
                )
    return None
