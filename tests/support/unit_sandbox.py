"""The unit's sandbox applied by hand, for a machine where systemd is not PID 1.

``systemd-run`` needs a running systemd; here the test applies what ``systemd/gpushare.service``
asks for itself, with the same kernel mechanisms systemd uses, and runs a command under it::

    unshare --mount --uts --propagation slave python -m tests.support.unit_sandbox UNIT -- ARGV...

(:func:`sandbox_argv` builds that line.) In order: the mounts (``ProtectSystem=``,
``ProtectKernelTunables=`` with ``ReadWritePaths=``, ``ProtectKernelModules=``,
``ProtectKernelLogs=``, ``ProtectProc=``), the limits and the umask, the capability bounding set,
then one seccomp filter (``SystemCallFilter=`` with ``SystemCallErrorNumber=``,
``SystemCallArchitectures=``, ``RestrictAddressFamilies=``, ``RestrictNamespaces=``,
``LockPersonality=``, ``RestrictSUIDSGID=``) built with libseccomp, and ``exec``.

:data:`APPLIED` says how each sandbox directive is reproduced; :data:`NOT_SANDBOX` lists the
unit's other settings. A directive in neither fails the test, so one cannot be added to the unit
without being tried here. What is approximate: a refused socket family gets EPERM (systemd:
EAFNOSUPPORT); ``RestrictSUIDSGID=`` covers chmod and mkdir, not a creat/open that asks for the
bits; the device cgroup (which ``ProtectClock=`` would add) is not reproduced at all.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from functools import cache
from pathlib import Path

APPLIED = {
    "CapabilityBoundingSet": "prctl(PR_CAPBSET_DROP) of every other capability before exec",
    "ProtectSystem": "full: /usr, /boot, /efi, /etc bound onto themselves and remounted read-only",
    "ReadWritePaths": "left read-write (or bound onto itself read-write) under the read-only trees",
    "ProtectKernelTunables": "/proc/sys and every mount under /sys remounted read-only",
    "ProtectKernelModules": "an empty mode-000 tmpfs over /usr/lib/modules",
    "ProtectKernelLogs": "an empty mode-000 file bound over /proc/kmsg and /dev/kmsg",
    "ProtectHostname": "a new UTS namespace (unshare --uts); sethostname is outside the filter",
    "ProtectProc": "a new procfs instance mounted with hidepid=invisible",
    "PrivateMounts": "a new mount namespace with slave propagation (unshare --mount)",
    "LockPersonality": "seccomp: personality() only with PER_LINUX or the query 0xffffffff",
    "RestrictSUIDSGID": "seccomp: chmod/fchmod/fchmodat/mkdir/mkdirat without S_ISUID|S_ISGID",
    "RestrictNamespaces": "seccomp: unshare/clone without CLONE_NEW*, no setns, clone3 ENOSYS",
    "RestrictAddressFamilies": "seccomp: socket() only for the listed families",
    "SystemCallArchitectures": "seccomp: the filter holds the native architecture only",
    "SystemCallFilter": "seccomp: the groups expanded by `systemd-analyze syscall-filter`",
    "SystemCallErrorNumber": "seccomp: the default action returns this errno",
    "UMask": "umask() before exec",
    "LimitNOFILE": "setrlimit(RLIMIT_NOFILE) before exec",
}
NOT_SANDBOX = {
    "Type", "ExecStart", "ExecReload", "Restart", "RestartSec", "WatchdogSec", "TimeoutStartSec",
    "TimeoutStopSec", "RuntimeDirectory", "RuntimeDirectoryMode", "RuntimeDirectoryPreserve",
    "StateDirectory", "StateDirectoryMode", "ConfigurationDirectory", "Delegate", "KillMode",
    "NotifyAccess",
}  # fmt: skip

CAPS = (
    "chown dac_override dac_read_search fowner fsetid kill setgid setuid setpcap "
    "linux_immutable net_bind_service net_broadcast net_admin net_raw ipc_lock ipc_owner "
    "sys_module sys_rawio sys_chroot sys_ptrace sys_pacct sys_admin sys_boot sys_nice "
    "sys_resource sys_time sys_tty_config mknod lease audit_write audit_control setfcap "
    "mac_override mac_admin syslog wake_alarm block_suspend audit_read perfmon bpf "
    "checkpoint_restore"
).split()
_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17}
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
_CLONE_NEW_ALL = _CLONE_NEW | 0x40000000 | 0x00000080  # + CLONE_NEWNET, CLONE_NEWTIME
_SETID_BITS = 0o6000
_PR_CAPBSET_DROP = 24


def service_settings(unit: Path) -> dict[str, list[str]]:
    """The ``[Service]`` section: each key with its values, in order."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def sandbox_argv(unit: Path, argv: Iterable[str]) -> list[str]:
    """The command line that runs ``argv`` under the unit's sandbox (as root)."""
    return [
        "unshare", "--mount", "--uts", "--propagation", "slave",
        sys.executable, "-m", "tests.support.unit_sandbox", str(unit), "--", *argv,
    ]  # fmt: skip


def _mounts() -> list[Path]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        out.append(Path(point))
    return out


def _under(path: Path, tops: Iterable[Path]) -> bool:
    return any(path == t or t in path.parents for t in tops)


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, timeout=30)


def _read_only(trees: list[Path], keep_rw: list[Path]) -> None:
    """Every mount at or under ``trees`` read-only, except those at or under ``keep_rw``."""
    for tree in trees:
        if tree not in _mounts():
            _mount("--rbind", str(tree), str(tree))
    for point in _mounts():
        if _under(point, trees) and not _under(point, keep_rw):
            _mount("-o", "remount,bind,ro", str(point))
    for path in keep_rw:
        if _under(path, trees) and path not in _mounts():
            _mount("--bind", str(path), str(path))
            _mount("-o", "remount,bind,rw", str(path))


def _inaccessible_file() -> str:
    fd, name = tempfile.mkstemp(prefix="inaccessible-")
    os.close(fd)
    os.chmod(name, 0)
    return name


def apply_mounts(s: dict[str, list[str]]) -> None:
    """The file-system directives, in this new mount namespace."""
    keep_rw = [Path(p.lstrip("-")) for v in s.get("ReadWritePaths", []) for p in v.split()]
    if s.get("ProtectProc", ["default"])[-1] == "invisible":
        _mount("-t", "proc", "-o", "hidepid=invisible", "proc", "/proc")
    mode = s.get("ProtectSystem", ["no"])[-1]
    if mode in ("yes", "full", "strict"):
        trees = [Path(p) for p in ("/usr", "/boot", "/efi")]
        trees += [Path("/etc")] if mode != "yes" else []
        _read_only([t for t in trees if t.is_dir() and not t.is_symlink()], keep_rw)
    if s.get("ProtectKernelTunables", ["no"])[-1] == "yes":
        _read_only([Path("/proc/sys"), Path("/sys")], keep_rw)
    if s.get("ProtectKernelModules", ["no"])[-1] == "yes":
        for modules in (Path("/usr/lib/modules"), Path("/lib/modules")):
            if modules.is_dir() and not modules.is_symlink():
                _mount("-t", "tmpfs", "-o", "ro,mode=000", "tmpfs", str(modules))
    if s.get("ProtectKernelLogs", ["no"])[-1] == "yes":
        blank = _inaccessible_file()
        try:
            for node in ("/proc/kmsg", "/dev/kmsg"):
                if Path(node).exists():
                    _mount("--bind", blank, node)
        finally:
            os.unlink(blank)  # the bind mounts keep its inode: nothing is left in the host's /tmp


@cache
def _filter_groups() -> dict[str, list[str]]:
    out = subprocess.run(
        ["systemd-analyze", "syscall-filter"], capture_output=True, text=True, timeout=30
    ).stdout
    groups: dict[str, list[str]] = {}
    current: list[str] = []
    for line in out.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif line.startswith("    ") and not line.strip().startswith("#"):
            current.append(line.strip())
    return groups


def expand(names: Iterable[str]) -> set[str]:
    """System call names of ``names`` (groups expanded recursively, as systemd does)."""
    out: set[str] = set()
    for name in names:
        if name.startswith("@"):
            out |= expand(_filter_groups()[name])
        else:
            out.add(name)
    return out


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]  # fmt: skip


_EQ, _MASKED_EQ = 4, 7
_ALLOW = 0x7FFF0000


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


def apply_seccomp(s: dict[str, list[str]]) -> None:
    """One filter for every seccomp-based directive; NO_NEW_PRIVS stays off, as in the unit."""
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_Arg)
    ]  # fmt: skip
    errno_name = s.get("SystemCallErrorNumber", ["EPERM"])[-1]
    ctx = ctypes.c_void_p(lib.seccomp_init(_errno_action(getattr(errno, errno_name))))
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_attr_set(ctx, 3, 0)  # SCMP_FLTATR_CTL_NNP: the unit has no NoNewPrivileges=

    def rule(name: str, action: int = _ALLOW, *args: tuple[int, int, int, int]) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return  # not a system call of this architecture
        arr = (_Arg * max(1, len(args)))(*[_Arg(*a) for a in args])
        rc = lib.seccomp_rule_add_array(ctx, action, nr, len(args), arr)
        if rc < 0:
            raise OSError(-rc, f"seccomp_rule_add {name}")

    allowed = expand(" ".join(s.get("SystemCallFilter", ["@default"])).split())
    conditional: dict[str, list[tuple[int, int, int, int]]] = {}
    if s.get("RestrictAddressFamilies"):
        families = " ".join(s["RestrictAddressFamilies"]).split()
        conditional["socket"] = [(0, _EQ, _FAMILIES[f], 0) for f in families]
    if s.get("LockPersonality", ["no"])[-1] == "yes":
        conditional["personality"] = [(0, _EQ, 0, 0), (0, _EQ, 0xFFFFFFFF, 0)]
    if s.get("RestrictSUIDSGID", ["no"])[-1] == "yes":
        for name, pos in (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("mkdir", 1),
                          ("mkdirat", 2)):  # fmt: skip
            conditional[name] = [(pos, _MASKED_EQ, _SETID_BITS, 0)]
    if s.get("RestrictNamespaces", ["no"])[-1] == "yes":
        conditional["unshare"] = [(0, _MASKED_EQ, _CLONE_NEW_ALL, 0)]
        conditional["clone"] = [(0, _MASKED_EQ, _CLONE_NEW, 0)]
        allowed.discard("setns")
        allowed.discard("clone3")
        rule("clone3", _errno_action(errno.ENOSYS))
    for name in sorted(allowed):
        if name in conditional:
            for cond in conditional[name]:
                rule(name, _ALLOW, cond)
        else:
            rule(name)
    rc = lib.seccomp_load(ctx)
    if rc < 0:
        raise OSError(-rc, "seccomp_load")


def apply(unit: Path) -> None:
    """Everything :data:`APPLIED` names, to this process (in its own namespaces already)."""
    s = service_settings(unit)
    unknown = set(s) - set(APPLIED) - NOT_SANDBOX
    if unknown:
        raise SystemExit(f"unit_sandbox: no way to apply {sorted(unknown)}: add it here")
    apply_mounts(s)
    if "LimitNOFILE" in s:
        n = int(s["LimitNOFILE"][-1])
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
        except ValueError:
            # A sandbox of the test machine's own (gVisor) caps it: as much as it allows.
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if "UMask" in s:
        os.umask(int(s["UMask"][-1], 8))
    if "CapabilityBoundingSet" in s:
        keep = {
            c.lower().removeprefix("cap_") for v in s["CapabilityBoundingSet"] for c in v.split()
        }
        libc = ctypes.CDLL(None, use_errno=True)
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        for number, name in enumerate(CAPS[: last + 1]):
            if name not in keep and libc.prctl(_PR_CAPBSET_DROP, number, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), f"PR_CAPBSET_DROP {name}")
    apply_seccomp(s)


def main(argv: list[str]) -> None:
    """``UNIT -- ARGV...``: apply the unit's sandbox, then exec ARGV."""
    unit, sep, *command = argv
    if sep != "--" or not command:
        raise SystemExit("usage: python -m tests.support.unit_sandbox UNIT -- ARGV...")
    apply(Path(unit))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
