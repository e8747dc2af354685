"""The adoption scan's memory of the host's processes: each one's facts read once, then checked.

Reading every process's ``stat``, ``status``, ``cgroup`` and ``environ`` at every scan (every
``daemon.adopt_scan_period``) made the scan the daemon's largest cost on an idle node
(``bench/daemon_overhead.py``). What is read, and how often:

- the list of pids (``/proc`` itself): every scan. A new pid is read in full at once, so a new
  process is decided at the first scan that sees it, and a gone one is dropped.
- ``/proc/<pid>/stat`` of a known pid: at every scan while the process is younger than
  :data:`RECENT_S` (60 s: a forked child may exec its real program seconds after the fork, and its
  children must not be decided before it is); then at least every ``verify_s`` (10 s, each pid at
  its own random point of 5-15 s, so the reads spread over the scans), and at once when NVML's
  list of the process's GPUs changes. Its start time and the address of the environment say whether the
  cached facts are still this process's: a reused pid has another start time, and an ``exec``
  (which replaces the environment) lays the new one out elsewhere; a changed name is taken as an
  ``exec`` too. Any of these, and the process is read again in full. The parent and the name come
  from this read. Reading every pid's ``stat`` at every scan (2 s) was most of the idle daemon's
  scan (``bench/daemon_overhead.py``); a process older than a minute that execs another program
  is seen within ``verify_s`` instead, or at once when it comes onto a GPU (the default ``uses_gpu`` rule's
  case). A pid reused between two looks is caught before anything is done with it: adoption
  checks the start time of the process it takes
  (:func:`gpushare.node.procs.identity.is_same_process`).
- ``environ``: once per process image (the environment a process was started with never
  changes), and again when the rules ask for variables not read before.
- ``status`` (uid) and ``cgroup``: again every ``refresh_s`` (30 s) per process, since
  ``setuid`` or a move to another cgroup changes them without an ``exec``; a changed uid reads the
  process again in full (the environment's readability depends on it).
- the GPUs of a process come from NVML's process list at each scan, never from the cache.

Processes younger than ``min_age_s`` are read in full at every scan and not cached: between
``fork`` and ``exec``, and until a service manager moves them, they are not yet what they will be.
Pids that are gone are dropped, so the cache holds at most the host's processes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace

from gpushare.model import ProcessFacts
from gpushare.node.procs.facts import (
    Stamp,
    process_facts,
    process_owner,
    process_stamp,
    unit_of_cgroup,
)

DEFAULT_REFRESH_S = 30.0
"""How often a cached process's uid and cgroup are read again."""

DEFAULT_VERIFY_S = 10.0
"""How often, on average, a known process's ``stat`` is read to check it is the same image."""

RECENT_S = 60.0
"""A process younger than this has its ``stat`` read at every scan (see :meth:`FactCache._trusted`)."""

FactsOf = Callable[
    [int, Collection[str], Mapping[int, tuple[str, ...]] | None], ProcessFacts | None
]


@dataclass(slots=True)
class _Entry:
    image: tuple[int, int, int]
    name: str
    facts: ProcessFacts | None  # None: a kernel thread (never adopted, never read again)
    refresh_at: float
    verify_at: float  # when its stat is read again (sooner if its GPUs change)


class FactCache:
    """Each process's facts, kept while its ``stat`` says it is the same process image.

    Args:
        facts_of: reads a process in full (:func:`gpushare.node.procs.facts.process_facts`).
        stamp_of: :func:`gpushare.node.procs.facts.process_stamp`.
        owner_of: :func:`gpushare.node.procs.facts.process_owner`.
        refresh_s: how often the uid and cgroup of a cached process are read again.
        verify_s: how often, on average, a cached process's ``stat`` is checked (0: every read).
    """

    def __init__(
        self,
        *,
        facts_of: FactsOf = process_facts,
        stamp_of: Callable[[int], Stamp | None] = process_stamp,
        owner_of: Callable[[int], tuple[int, str | None] | None] = process_owner,
        refresh_s: float = DEFAULT_REFRESH_S,
        verify_s: float = DEFAULT_VERIFY_S,
    ) -> None:
        self._facts_of = facts_of
        self._stamp_of = stamp_of
        self._owner_of = owner_of
        self.refresh_s = refresh_s
        self.verify_s = verify_s
        self.stamp_reads = 0  # for the tests and the bench: how many stat reads the scans made
        self._entries: dict[int, _Entry] = {}
        self._names: frozenset[str] = frozenset()

    def __len__(self) -> int:
        return len(self._entries)

    def read(
        self,
        pids: Collection[int],
        names: Collection[str],
        gpu_pids: Mapping[int, tuple[str, ...]] | None,
        *,
        now: float,
        min_age_s: float,
        clients: Collection[int] = (),
    ) -> tuple[list[ProcessFacts], bool]:
        """The facts of ``pids`` (those still there), and whether any differ from the last read.

        Args:
            pids: the host's processes now.
            names: the environment variables the rules read.
            gpu_pids: :func:`gpushare.daemon.adopter.gpu_processes`.
            now: wall-clock seconds, the unit of :attr:`ProcessFacts.start_time`.
            min_age_s: younger processes are read in full and not kept.
            clients: pids that are clients: the scan skips them, so once read they are taken as
                they were until they are gone (no ``stat`` read).
        """
        wanted = frozenset(names)
        if not wanted <= self._names:
            self._entries.clear()  # new variables to read: every environment again
            self._names = wanted
        entries = self._entries
        gone = entries.keys() - set(pids)
        for pid in gone:
            del entries[pid]
        changed = bool(gone)
        out: list[ProcessFacts] = []
        for pid in pids:
            entry = entries.get(pid)
            gpus = None if gpu_pids is None else gpu_pids.get(pid, ())
            if entry is not None and (
                (pid in clients and entry.facts is not None) or self._trusted(entry, gpus, now)
            ):
                kept = entry.facts
                if kept is None:
                    continue  # a kernel thread
                seen: ProcessFacts | None = kept
                if now >= entry.refresh_at:
                    seen = self._refresh(pid, entry, kept, gpu_pids, now)
                if seen is None:
                    changed = True
                    continue
                changed = changed or seen is not kept
                out.append(seen)
                continue
            self.stamp_reads += 1
            stamp = self._stamp_of(pid)
            if stamp is None or stamp.state in ("Z", "X"):
                if entry is not None:
                    del entries[pid]
                    changed = True
                continue
            if entry is not None and (entry.image != stamp.image or entry.name != stamp.name):
                del entries[pid]
                entry = None
            if entry is None:
                changed = True
                entry = self._read(pid, stamp, gpu_pids, now, min_age_s)
                if entry is None:
                    continue
            else:
                entry.verify_at = self._next_verify(now)
            before = f = entry.facts
            if f is None:
                continue  # a kernel thread
            if now >= entry.refresh_at:
                f = self._refresh(pid, entry, f, gpu_pids, now)
                if f is None:
                    changed = True
                    continue
            if f.ppid != stamp.ppid or f.gpu_uuids != gpus:
                f = entry.facts = replace(f, ppid=stamp.ppid, gpu_uuids=gpus)
            changed = changed or f is not before
            out.append(f)
        return out, changed

    def _read(
        self,
        pid: int,
        stamp: Stamp,
        gpu_pids: Mapping[int, tuple[str, ...]] | None,
        now: float,
        min_age_s: float,
    ) -> _Entry | None:
        verify_at = self._next_verify(now)
        if stamp.kernel_thread:
            entry = _Entry(stamp.image, stamp.name, None, float("inf"), verify_at)
            self._entries[pid] = entry
            return entry
        f = self._facts_of(pid, self._names, gpu_pids)
        if f is None:
            return None
        entry = _Entry(stamp.image, f.name, f, now + self.refresh_s, verify_at)
        if now - f.start_time >= min_age_s and f.name == stamp.name:
            self._entries[pid] = entry  # young ones are read again next time (module docstring)
        return entry

    def _refresh(
        self,
        pid: int,
        entry: _Entry,
        f: ProcessFacts,
        gpu_pids: Mapping[int, tuple[str, ...]] | None,
        now: float,
    ) -> ProcessFacts | None:
        entry.refresh_at = now + self.refresh_s
        owner = self._owner_of(pid)
        if owner is None:
            del self._entries[pid]
            return None
        uid, cgroup = owner
        if uid != f.uid:
            del self._entries[pid]
            fresh = self._facts_of(pid, self._names, gpu_pids)
            if fresh is not None:
                self._entries[pid] = _Entry(
                    entry.image, fresh.name, fresh, entry.refresh_at, entry.verify_at
                )
            return fresh
        if cgroup != f.cgroup:
            f = entry.facts = replace(f, cgroup=cgroup, unit=unit_of_cgroup(cgroup))
        return f

    def _next_verify(self, now: float) -> float:
        # Spread: processes first seen together are not all checked again in the same scan.
        return now + self.verify_s * (0.5 + random.random())

    @staticmethod
    def _trusted(entry: _Entry, gpus: tuple[str, ...] | None, now: float) -> bool:
        """Whether a cached process is taken as it was without reading its ``stat`` now."""
        f = entry.facts
        if f is None:
            return now < entry.verify_at  # a kernel thread
        # A recent process is looked at every scan: a forked child may exec its real program
        # seconds later (slurmstepd runs the TaskProlog in between), and its children must not
        # be decided before it is. So is one that comes onto a GPU (or leaves it): it may have
        # exec'd into the program a uses_gpu rule is waiting for.
        return now < entry.verify_at and now - f.start_time >= RECENT_S and f.gpu_uuids == gpus
