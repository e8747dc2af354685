"""``gpushare install`` / ``gpushare uninstall``: put the daemon on a host as a systemd service.

Install, in order, each step idempotent (a second run reports ``unchanged``):

1. the directories ``/etc/gpushare`` (0755) and ``/var/lib/gpushare`` (0711: the registry holds
   submitted environments, and nobody else may list it; a looser existing one is tightened);
2. ``/etc/gpushare/gpushare.toml``, the documented default, unless a file is there: an edited file
   is never overwritten (``kept``), and it is validated; an invalid one stops the install before
   systemd is told anything;
3. the host files, gpushare's own (replaced when they differ; local changes to the unit belong in
   ``gpushare.service.d/`` drop-ins, which are never touched): ``/etc/systemd/system/gpushare.service``,
   ``/etc/sysusers.d/gpushare.conf``, ``/etc/tmpfiles.d/gpushare.conf`` and the man pages
   ``gpushare(8)`` and ``gpushare.toml(5)`` under ``/usr/local/share/man`` (the unit's
   ``Documentation=``);
4. ``/usr/bin/gpushare``, a symlink to the console script of the installation that runs this;
5. the admin group (``daemon.admin_group``, ``gpushare`` by default) with ``groupadd --system``;
6. the in-flight bound a bounded shallow offline queue preloads (``gpushare.native``), compiled from
   the shipped ``inflight.c`` with the host's C compiler, next to the package (without a compiler
   this is ``skipped``: shallow queues then use ``CUDA_LAUNCH_BLOCKING=1``);
7. ``systemctl daemon-reload`` and ``systemctl enable --now gpushare`` (a restart is left to the
   operator: the running daemon is never disturbed).

Uninstall reverses it: ``systemctl disable --now`` (workloads keep running: ``KillMode=process``),
the unit, the config when it is still the shipped default, the symlink, the group when nobody is in
it; ``/var/lib/gpushare`` (the client registry) and an edited config stay unless ``purge``.

Everything is relative to ``root`` (``/`` on a host), so the whole sequence runs against a
temporary directory in tests: ``groupadd --prefix`` and ``systemctl --root`` work on files there.
A dry run needs nothing of the host: what a real run would lack (root, systemd, groupadd) is
reported in its steps instead of stopping it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpushare import config, native, paths, shipped
from gpushare.native import build as native_build

UNIT_NAME = "gpushare.service"
CONFIG_DIR = Path("/etc/gpushare")
UNIT_FILE = Path("/etc/systemd/system") / UNIT_NAME
DROP_IN_DIR = Path("/etc/systemd/system") / f"{UNIT_NAME}.d"
#: Where each shipped host file goes (besides the config, which is never overwritten).
HOST_FILES = (
    (shipped.UNIT, UNIT_FILE, "the unit"),
    (shipped.SYSUSERS, Path("/etc/sysusers.d/gpushare.conf"), "sysusers.d: the admin group"),
    (shipped.TMPFILES, Path("/etc/tmpfiles.d/gpushare.conf"), "tmpfiles.d: state and run dirs"),
    (shipped.MAN_PAGES[0], Path("/usr/local/share/man/man8/gpushare.8"), "man page gpushare(8)"),
    (
        shipped.MAN_PAGES[1],
        Path("/usr/local/share/man/man5/gpushare.toml.5"),
        "man page gpushare.toml(5)",
    ),
)
BIN_LINK = Path("/usr/bin/gpushare")
SYSTEMD_RUNNING = Path("/run/systemd/system")
_COMMAND_TIMEOUT_S = 120.0

Result = Literal["created", "updated", "unchanged", "kept", "removed", "skipped", "failed"]
_WOULD = {"created": "would create", "updated": "would update", "removed": "would remove"}


class InstallError(Exception):
    """The host cannot be installed on as asked; nothing was changed. The message names the fix."""


@dataclass(frozen=True, slots=True)
class Step:
    """One thing install or uninstall did (or, in a dry run, would do)."""

    what: str
    result: Result
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Options:
    """What the operator asked for."""

    root: Path = Path("/")
    dry_run: bool = False
    systemd: bool = True
    purge: bool = False
    #: Where the in-flight bound is built (``None``: next to :mod:`gpushare.native`).
    library: Path | None = None


@dataclass(frozen=True, slots=True)
class Report:
    """Every step, and whether the whole operation succeeded."""

    command: str
    root: str
    dry_run: bool
    steps: tuple[Step, ...]
    ok: bool

    def as_dict(self) -> dict[str, object]:
        """The report as JSON-ready data."""
        return {
            "command": self.command,
            "root": self.root,
            "dry_run": self.dry_run,
            "ok": self.ok,
            "steps": [dataclasses.asdict(s) for s in self.steps],
        }

    def render(self) -> str:
        """One line per step: result, what, detail."""
        lines = []
        for s in self.steps:
            word = _WOULD.get(s.result, s.result) if self.dry_run else s.result
            lines.append(f"{word:<13} {s.what}" + (f"  ({s.detail})" if s.detail else ""))
        return "\n".join(lines) + "\n"


def console_script() -> Path | None:
    """The ``gpushare`` command of the installation running this, or ``None``."""
    beside = Path(sys.executable).parent / "gpushare"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("gpushare")
    return Path(found) if found else None


class _Host:
    """Paths under the target root, and the commands that change users and systemd there."""

    def __init__(self, opts: Options, run: Callable[[Sequence[str]], tuple[int, str]]) -> None:
        self.opts = opts
        self.root = opts.root
        self.on_host = opts.root.resolve() == Path("/")
        self._run = run

    def at(self, path: Path) -> Path:
        return self.root / path.relative_to("/")

    def command(self, argv: Sequence[str]) -> tuple[int, str]:
        return self._run(argv)

    def group(self, name: str) -> tuple[bool, list[str]]:
        """Whether the group exists under the root, and its members."""
        if self.on_host:
            try:
                entry = grp.getgrnam(name)
            except KeyError:
                return False, []
            primary = {p.pw_name for p in pwd.getpwall() if p.pw_gid == entry.gr_gid}
            return True, sorted(set(entry.gr_mem) | primary)
        for line in _lines(self.at(Path("/etc/group"))):
            fields = line.split(":")
            if len(fields) >= 4 and fields[0] == name:
                return True, [m for m in fields[3].split(",") if m]
        return False, []

    def prefix_args(self) -> list[str]:
        return [] if self.on_host else ["--prefix", str(self.root)]

    def systemctl(self, *args: str) -> list[str]:
        return ["systemctl", *([] if self.on_host else [f"--root={self.root}"]), *args]


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _run(argv: Sequence[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return done.returncode, (done.stderr or done.stdout).strip()


def _preflight(opts: Options, command: str) -> list[Step]:
    """What stops ``command`` on this host; a dry run gets it as steps, a real run as an error.

    Raises:
        InstallError: a precondition fails and this is not a dry run.
    """
    if not opts.root.is_dir():
        raise InstallError(f"--root {opts.root} is not a directory: create it first")
    if lost := shipped.missing():
        raise InstallError(
            f"this gpushare installation lacks {', '.join(lost)}: reinstall it "
            "(pip install --force-reinstall gpushare)"
        )
    on_host = opts.root.resolve() == Path("/")
    problems: list[tuple[str, str]] = []
    if on_host and os.geteuid() != 0:
        problems.append((
            "root",
            f"gpushare {command} changes /etc and /usr/bin and must run as root: "
            f"sudo gpushare {command} (or --dry-run to see what it would do)",
        ))  # fmt: skip
    if opts.systemd:
        if shutil.which("systemctl") is None:
            problems.append((
                "systemd",
                "systemctl not found: gpushare runs as a systemd service; "
                f"use --no-systemd to {command} the files only",
            ))  # fmt: skip
        elif on_host and not SYSTEMD_RUNNING.is_dir():
            problems.append((
                "systemd",
                f"systemd is not running on this host ({SYSTEMD_RUNNING} is missing): use "
                f"--no-systemd to {command} the files only and run `gpushare daemon` yourself",
            ))  # fmt: skip
    tool = "groupadd" if command == "install" else "groupdel"
    if shutil.which(tool) is None:
        problems.append((tool, f"{tool} not found: install the passwd package (shadow utilities)"))
    if problems and not opts.dry_run:
        raise InstallError(problems[0][1])
    return [Step(what, "skipped", f"a real run would stop here: {why}") for what, why in problems]


def install(opts: Options, run: Callable[[Sequence[str]], tuple[int, str]] = _run) -> Report:
    """Install gpushare on the host under ``opts.root``; see the module docstring.

    Raises:
        InstallError: a precondition fails (not root, no systemd, no console script); nothing
            was changed.
    """
    blockers = _preflight(opts, "install")
    script = console_script()
    if script is None:
        raise InstallError(
            f"no gpushare command beside {sys.executable} or on PATH: install the package "
            "first (python3 -m venv /opt/gpushare && /opt/gpushare/bin/pip install gpushare)"
        )
    host = _Host(opts, run)
    steps = [
        *blockers,
        # The state directory as the daemon keeps it (daemon/statedir.py): closed to listing.
        _ensure_dir(host, CONFIG_DIR, 0o755),
        _ensure_dir(host, paths.STATE_DIR, 0o711),
    ]
    config_step, cfg = _install_config(host)
    steps.append(config_step)
    steps.extend(_install_file(host, name, dest, what) for name, dest, what in HOST_FILES)
    steps.append(_link_bin(host, script))
    if cfg is not None:
        steps.append(_add_group(host, cfg.daemon.admin_group))
        steps.append(_build_inflight(host, cfg))
    if cfg is None:
        steps.append(Step("systemd", "skipped", "the config is invalid: fix it, then run again"))
    elif not opts.systemd:
        steps.append(Step("systemd", "skipped", "--no-systemd"))
    elif not any(s.what == "systemd" for s in blockers):
        # (A dry run on a host without systemd has said so in its blocker step.)
        steps.append(_enable(host))
    return Report("install", str(opts.root), opts.dry_run, tuple(steps),
                  ok=all(s.result != "failed" for s in steps) and cfg is not None)  # fmt: skip


def uninstall(opts: Options, run: Callable[[Sequence[str]], tuple[int, str]] = _run) -> Report:
    """Remove what :func:`install` put on the host; the state directory only with ``purge``.

    Raises:
        InstallError: a precondition fails (not root, no systemd); nothing was changed.
    """
    steps = _preflight(opts, "uninstall")
    host = _Host(opts, run)
    group = _admin_group(host)  # read before the config may go
    systemd = opts.systemd and not any(s.what == "systemd" for s in steps)
    if systemd:
        steps.append(_disable(host))
    steps.extend(_remove_file(host, dest, what) for _name, dest, what in HOST_FILES)
    if opts.purge:
        steps.append(_remove_tree(host, DROP_IN_DIR, "the unit's drop-ins"))
    elif host.at(DROP_IN_DIR).exists():
        steps.append(Step(str(DROP_IN_DIR), "kept", "local drop-ins; --purge removes them"))
    if systemd and host.on_host:
        steps.append(_systemctl(host, "daemon-reload"))
    steps.append(_remove_config(host))
    steps.append(_unlink_bin(host))
    steps.append(_remove_group(host, group))
    if opts.purge:
        steps.append(_remove_tree(host, paths.STATE_DIR, "the client registry and logs"))
        steps.append(_remove_tree(host, paths.RUNTIME_DIR, "sockets and MPS pipe directories"))
    else:
        state = host.at(paths.STATE_DIR)
        if state.exists():
            steps.append(
                Step(str(paths.STATE_DIR), "kept", "client registry and logs; --purge removes it")
            )
    return Report("uninstall", str(opts.root), opts.dry_run, tuple(steps),
                  ok=all(s.result != "failed" for s in steps))  # fmt: skip


# --------------------------------------------------------------------------------------- install


def _ensure_dir(host: _Host, path: Path, mode: int) -> Step:
    target = host.at(path)
    if target.is_dir():
        current = target.stat().st_mode & 0o777
        if current & ~mode == 0:
            return Step(str(path), "unchanged")
        # Tighten only: a mode the operator made stricter stays.
        if not host.opts.dry_run:
            target.chmod(current & mode)
        return Step(str(path), "updated", f"mode {current:04o} -> {current & mode:04o}")
    if not host.opts.dry_run:
        target.mkdir(parents=True, mode=mode)
        target.chmod(mode)
    return Step(str(path), "created", f"directory, mode {mode:04o}")


def _write(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    _root_owned(tmp, 0o644)
    os.replace(tmp, target)


def _root_owned(path: Path, mode: int) -> None:
    """``mode`` (never group- or other-writable) and, when installing as root, owned by root.

    The daemon trusts only such files (gpushare.trust); a dry run or a test as another user keeps
    its own uid.
    """
    path.chmod(mode & ~0o022)
    if os.geteuid() == 0:
        os.chown(path, 0, 0)


def _install_config(host: _Host) -> tuple[Step, config.Config | None]:
    path = paths.CONFIG_FILE
    target = host.at(path)
    default = shipped.text(shipped.CONFIG)
    if not target.exists():
        if not host.opts.dry_run:
            _write(target, default)
        return Step(str(path), "created", "the documented default"), config.Config()
    try:
        current = target.read_text(encoding="utf-8")
        cfg = config.loads(current, path)
    except (OSError, UnicodeDecodeError) as exc:
        return Step(str(path), "failed", f"cannot read it: {exc}"), None
    except config.ConfigError as exc:
        return Step(str(path), "failed", f"kept, but invalid: {exc}"), None
    if current == default:
        return Step(str(path), "unchanged"), cfg
    return Step(str(path), "kept", "edited: not overwritten; it is valid"), cfg


def _install_file(host: _Host, name: str, dest: Path, what: str) -> Step:
    """A shipped host file, gpushare's own: replaced when it differs."""
    target = host.at(dest)
    text = shipped.text(name)
    if target.exists() and target.read_text(encoding="utf-8") == text:
        return Step(str(dest), "unchanged", what)
    result: Result = "updated" if target.exists() else "created"
    if not host.opts.dry_run:
        _write(target, text)
    detail = what
    if result == "updated" and dest == UNIT_FILE:
        detail = ("local changes belong in gpushare.service.d/ drop-ins; "
                  "systemctl restart gpushare uses it (workloads keep running)")  # fmt: skip
    return Step(str(dest), result, detail)


def _link_bin(host: _Host, script: Path) -> Step:
    link = host.at(BIN_LINK)
    if link.is_symlink():
        if Path(os.readlink(link)) == script:
            return Step(str(BIN_LINK), "unchanged", f"-> {script}")
        result: Result = "updated"
    elif link.exists():
        with contextlib.suppress(OSError):
            if link.samefile(script):
                return Step(str(BIN_LINK), "unchanged", "this installation")
        return Step(str(BIN_LINK), "kept", "another gpushare is installed there; the unit runs it")
    else:
        result = "created"
    if not host.opts.dry_run:
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(".gpushare.tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        tmp.symlink_to(script)
        os.replace(tmp, link)
    return Step(str(BIN_LINK), result, f"-> {script}")


def _add_group(host: _Host, name: str) -> Step:
    what = f"group {name}" if name else "admin group"
    if not name:
        return Step(what, "skipped", "daemon.admin_group is empty")
    if host.group(name)[0]:
        return Step(what, "unchanged")
    if not host.opts.dry_run:
        code, out = host.command(["groupadd", "--system", *host.prefix_args(), name])
        if code != 0:
            return Step(what, "failed", f"groupadd: {out}")
    return Step(what, "created", "members may cancel, pause and resume anyone's clients")


def _systemctl(host: _Host, *args: str) -> Step:
    what = "systemctl " + " ".join(args)
    if not host.opts.dry_run:
        code, out = host.command(host.systemctl(*args))
        if code != 0:
            return Step(what, "failed", out)
    return Step(what, "updated")


def _build_inflight(host: _Host, cfg: config.Config) -> Step:
    opts = host.opts
    configured = cfg.paths.inflight_library
    # A configured path is the host's, so it lies under --root; the default is the package's own.
    lib = opts.library or native.library_path(host.at(configured) if configured else None)
    if cfg.gate.shallow_queue != "bounded":
        return Step(str(lib), "skipped", '[gate] shallow_queue = "blocking" does not use it')
    if lib.is_file() and lib.stat().st_mtime >= native_build.SOURCE.stat().st_mtime:
        return Step(str(lib), "unchanged")
    result: Result = "updated" if lib.is_file() else "created"
    what = "the in-flight bound for shallow offline queues"
    if opts.dry_run:
        return Step(str(lib), result, f"{what}, compiled from {native_build.SOURCE.name}")
    # Created as root's and not writable by others from the first byte (a umask of 0 would leave
    # a window in which another user could open it for writing): clients of every user, root's
    # among them, preload it, and the daemon refuses it otherwise (gpushare.trust).
    umask = os.umask(0o022)
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)  # [paths] inflight_library's directory
        ok, line = native_build.build(lib)
    finally:
        os.umask(umask)
    if ok:
        _root_owned(lib, 0o755)
        return Step(str(lib), result, what)
    if native_build.compiler() is None:
        # Not a failure: shallow queues still work, blocking; the daemon warns at start.
        return Step(str(lib), "skipped", f"{line}; shallow queues use CUDA_LAUNCH_BLOCKING=1")
    return Step(str(lib), "failed", line)


def _enable(host: _Host) -> Step:
    enabled = host.command(host.systemctl("is-enabled", UNIT_NAME))[0] == 0
    if not host.on_host:
        # systemctl --root edits the unit's symlinks offline; nothing can be started there.
        if enabled:
            return Step(f"systemctl enable {UNIT_NAME}", "unchanged", "enabled")
        return _systemctl(host, "enable", UNIT_NAME)
    if enabled and host.command(host.systemctl("is-active", UNIT_NAME))[0] == 0:
        return Step(f"systemctl enable --now {UNIT_NAME}", "unchanged", "enabled and running")
    reload = _systemctl(host, "daemon-reload")
    if reload.result == "failed":
        return reload
    return _systemctl(host, "enable", "--now", UNIT_NAME)


# ------------------------------------------------------------------------------------- uninstall


def _disable(host: _Host) -> Step:
    if not host.at(UNIT_FILE).exists():
        return Step(f"systemctl disable {UNIT_NAME}", "skipped", "no unit installed")
    args = ("disable", "--now", UNIT_NAME) if host.on_host else ("disable", UNIT_NAME)
    step = _systemctl(host, *args)
    if step.result == "failed":
        return step
    return dataclasses.replace(step, result="removed", detail="workloads keep running")


def _remove_file(host: _Host, path: Path, what: str) -> Step:
    target = host.at(path)
    if not target.exists() and not target.is_symlink():
        return Step(str(path), "unchanged", "not there")
    if not host.opts.dry_run:
        target.unlink()
    return Step(str(path), "removed", what)


def _remove_tree(host: _Host, path: Path, what: str) -> Step:
    target = host.at(path)
    if not target.exists():
        return Step(str(path), "unchanged", "not there")
    if not host.opts.dry_run:
        shutil.rmtree(target)
    return Step(str(path), "removed", what)


def _remove_config(host: _Host) -> Step:
    path = paths.CONFIG_FILE
    target = host.at(path)
    if target.exists():
        edited = target.read_bytes() != shipped.text(shipped.CONFIG).encode()
        if edited and not host.opts.purge:
            return Step(str(path), "kept", "edited; --purge removes it")
        step = _remove_file(host, path, "edited" if edited else "the shipped default")
    else:
        step = Step(str(path), "unchanged", "not there")
    directory = host.at(CONFIG_DIR)
    if not host.opts.dry_run and directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()
    return step


def _unlink_bin(host: _Host) -> Step:
    link = host.at(BIN_LINK)
    if link.is_symlink():
        return _remove_file(host, BIN_LINK, f"-> {os.readlink(link)}")
    if link.exists():
        return Step(str(BIN_LINK), "kept", "a regular file, not the link install made")
    return Step(str(BIN_LINK), "unchanged", "not there")


def _admin_group(host: _Host) -> str:
    cfg_file = host.at(paths.CONFIG_FILE)
    with contextlib.suppress(config.ConfigError):
        if cfg_file.exists():
            return config.load(cfg_file).daemon.admin_group
    return config.DaemonConfig().admin_group


def _remove_group(host: _Host, name: str) -> Step:
    what = f"group {name}" if name else "admin group"
    if not name:
        return Step(what, "skipped", "daemon.admin_group is empty")
    exists, members = host.group(name)
    if not exists:
        return Step(what, "unchanged", "not there")
    if members and not host.opts.purge:
        return Step(what, "kept", f"members: {', '.join(members)}; --purge removes it anyway")
    if not host.opts.dry_run:
        code, out = host.command(["groupdel", *host.prefix_args(), name])
        if code != 0:
            return Step(what, "failed", f"groupdel: {out}")
    return Step(what, "removed")
