"""Facts of processes gpushare did not start, for adoption: uid, cgroup, systemd unit, environment.

:func:`process_facts` reads what adoption rules match on (uid, cgroup, systemd unit, the
``GPUSHARE_*``/``CUDA_MPS_*`` environment) straight from ``/proc``; :func:`process_stamp` and
:func:`process_owner` tell whether cached facts still hold (``gpushare/daemon/factcache.py``).
"""

from __future__ import annotations

import functools
import os
import stat as stat_mod
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import NamedTuple

import psutil

from gpushare.model import ProcessFacts
from gpushare.node.procs.users import user_name

# systemd puts a unit's processes in a cgroup named after it; services and scopes hold processes,
# slices only hold other cgroups.
_UNIT_SUFFIXES = (".service", ".scope")
_PF_KTHREAD = 0x00200000  # include/linux/sched.h: the task is a kernel thread


def cgroup_v2_path(text: str) -> str | None:
    """The cgroup v2 path in the text of a ``/proc/<pid>/cgroup`` file (its ``0::`` line)."""
    for line in text.splitlines():
        hierarchy, _controllers, path = line.split(":", 2)
        if hierarchy == "0":
            return path
    return None


def process_cgroup(pid: int) -> str | None:
    """The cgroup v2 path of ``pid`` from the hierarchy's root, or ``None`` (gone, or no v2)."""
    try:
        return cgroup_v2_path(Path(f"/proc/{pid}/cgroup").read_text())
    except (FileNotFoundError, ProcessLookupError):
        return None


def unit_of_cgroup(path: str | None) -> str | None:
    """The systemd unit whose cgroup ``path`` lies in: the deepest ``.service``/``.scope`` part.

    ``/system.slice/triton.service`` gives ``triton.service``; a user's unit under
    ``user@1000.service/app.slice/x.service`` gives ``x.service``; a client cgroup in a delegated
    subtree (``.../gpushare.service/client-7``) gives ``gpushare.service``.
    """
    if not path:
        return None
    for part in reversed(path.strip("/").split("/")):
        if part.endswith(_UNIT_SUFFIXES):
            return part
    return None


def read_environ(pid: int, names: Collection[str]) -> dict[str, str] | None:
    """The variables of ``names`` in ``/proc/<pid>/environ`` (the environment it started with).

    Only the named variables are returned: the rest may hold secrets.

    Returns:
        The variables found (empty for a zombie or a kernel thread), or ``None`` when the process
        is gone.

    Raises:
        PermissionError: another user's process, and we are not root.
    """
    raw = _read_proc(pid, "environ")
    if raw is None:
        return None
    # Look each wanted name up rather than split the whole environment: a scan reads every
    # process's. The first occurrence wins, as getenv(3) finds it.
    buf = b"\0" + raw
    out: dict[str, str] = {}
    for name in names:
        key = b"\0" + name.encode() + b"="
        at = buf.find(key)
        if at < 0:
            continue
        begin = at + len(key)
        stop = buf.find(b"\0", begin)
        out[name] = buf[begin : stop if stop >= 0 else len(buf)].decode(errors="replace")
    return out


def all_pids() -> list[int]:
    """Every process now in ``/proc`` (this pid namespace), in pid order."""
    return sorted(int(e.name) for e in os.scandir("/proc") if e.name.isdigit())


def process_facts(
    pid: int, env_names: Collection[str], gpu_pids: Mapping[int, tuple[str, ...]] | None = None
) -> ProcessFacts | None:
    """What adoption needs to know about ``pid``; ``None`` when it is gone or a kernel thread.

    Read straight from ``/proc/<pid>/{stat,status,cgroup,environ}`` (the adoption scan reads every
    process of the host, ``bench/adopt_scan.py``). The start time is read first and checked again
    last, so facts of a process that exited (or a pid reused) while they were read are never
    returned as one process's facts.

    Args:
        pid: the process.
        env_names: the environment variables to keep (:func:`read_environ`).
        gpu_pids: pid to GPU UUIDs from NVML's compute-process lists; ``None`` where NVML is not
            available (``uses_gpu`` is then unknown, not false).
    """
    first = _comm_and_stat(pid)
    # Index 6 is field 9 (flags), index 19 field 22 (start time in clock ticks since boot).
    if first is None or int(first[1][6]) & _PF_KTHREAD:
        return None
    name, stat = first
    uid = _real_uid(pid)
    if uid is None:
        return None
    cgroup_text = _read_proc(pid, "cgroup")
    cgroup = cgroup_v2_path(cgroup_text.decode()) if cgroup_text is not None else None
    try:
        environ = read_environ(pid, env_names)
    except PermissionError:
        environ = None
    else:
        if environ is None:
            return None
    again = _comm_and_stat(pid)
    if again is None or again[1][19] != stat[19] or again[1][0] in ("Z", "X"):
        return None
    return ProcessFacts(
        pid=pid, ppid=int(stat[1]), uid=uid, user=user_name(uid), name=name,
        start_time=_boot_time() + int(stat[19]) / _CLK_TCK,
        cgroup=cgroup, unit=unit_of_cgroup(cgroup), environ=environ,
        gpu_uuids=None if gpu_pids is None else gpu_pids.get(pid, ()), setuid=runs_setuid(pid),
    )  # fmt: skip


_CLK_TCK = os.sysconf("SC_CLK_TCK")


class Stamp(NamedTuple):
    """What one read of ``/proc/<pid>/stat`` says about a process (:func:`process_stamp`)."""

    name: str
    ppid: int
    state: str
    kernel_thread: bool
    image: tuple[int, int, int]
    """Start time (clock ticks since boot) and the address range of the environment: a reused pid
    has another start time, and an ``exec`` lays out a new environment at another address."""


def process_stamp(pid: int) -> Stamp | None:
    """One read of ``/proc/<pid>/stat``: enough to tell whether cached facts still hold.

    The environment's addresses (fields 50 and 51) read as 0 where the reader may not trace the
    process; its environment is then unreadable anyway, and the name still changes on ``exec``.
    """
    first = _comm_and_stat(pid)
    if first is None:
        return None
    name, stat = first
    env = (int(stat[47]), int(stat[48])) if len(stat) > 48 else (0, 0)
    return Stamp(
        name, int(stat[1]), stat[0], bool(int(stat[6]) & _PF_KTHREAD), (int(stat[19]), *env)
    )


def process_owner(pid: int) -> tuple[int, str | None] | None:
    """The real uid and cgroup v2 path of ``pid`` (the facts that change without an ``exec``)."""
    uid = _real_uid(pid)
    cgroup_text = _read_proc(pid, "cgroup")
    if uid is None or cgroup_text is None:
        return None
    return uid, cgroup_v2_path(cgroup_text.decode())


@functools.cache
def _boot_time() -> float:
    # The same clock psutil's create_time uses (btime of /proc/stat), so start times compare.
    return float(psutil.boot_time())


def _read_proc(pid: int, name: str) -> bytes | None:
    # One open/read/close, without pathlib's overhead: the scan does this for every process.
    try:
        fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    except ProcessLookupError:
        return None
    finally:
        os.close(fd)


def _comm_and_stat(pid: int) -> tuple[str, list[str]] | None:
    raw = _read_proc(pid, "stat")
    if raw is None:
        return None
    start, end = raw.find(b"("), raw.rfind(b")")
    if not 0 <= start < end:
        return None
    return raw[start + 1 : end].decode(errors="replace"), raw[end + 2 :].decode().split()


def _real_uid(pid: int) -> int | None:
    raw = _read_proc(pid, "status")
    at = raw.find(b"\nUid:") if raw is not None else -1
    return int(raw[at + 5 :].split(None, 1)[0]) if raw is not None and at >= 0 else None


def _ids(raw: bytes, field: bytes) -> list[int]:
    at = raw.find(b"\n" + field)
    return (
        [int(x) for x in raw[at + len(field) + 1 :].split(b"\n", 1)[0].split()] if at >= 0 else []
    )


def runs_setuid(pid: int) -> bool:
    """Whether ``pid`` runs with rights its real user does not have.

    That is: its real, effective, saved and filesystem uids (or gids) differ, or its executable
    has the setuid or setgid bit. Such a process is adopted by root's rules only (gpushare.control.adoption): a user's rule must not
    make the daemon freeze, move or kill a process that acts with another user's rights.
    """
    raw = _read_proc(pid, "status")
    if raw is not None and any(len(set(_ids(raw, f))) > 1 for f in (b"Uid:", b"Gid:")):
        return True
    try:
        mode = os.stat(f"/proc/{pid}/exe").st_mode
    except OSError:
        return False  # gone, or a kernel thread: nothing to adopt either way
    return bool(mode & (stat_mod.S_ISUID | stat_mod.S_ISGID))
