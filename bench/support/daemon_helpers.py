"""Start and clean up a real daemon process (tests/support/daemon_proc.py) under a temporary directory."""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from bench.support.trusted import make_trusted_dir, trusted_base
from gpushare import native
from gpushare.client import ApiClient, ApiError
from gpushare.node.procs.identity import is_same_process
from gpushare.paths import repo_root

REPO = repo_root()


def wait_for(pred: Callable[[], Any], timeout_s: float = 5.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks."""
    data = Path(f"/proc/{pid}/stat").read_bytes()
    fields = data[data.rfind(b")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


class DaemonProc:
    """A daemon process with its own socket, database and client logs under a fresh /tmp dir."""

    def __init__(
        self,
        extra_toml: str = "",
        *,
        gpus: int = 2,
        env: dict[str, str] | None = None,
        daemon_toml: str = "",
        inflight_library: Path | None = None,
    ):
        # Unix socket paths are limited to 108 bytes: keep the base short.
        self.base = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
        self.base.chmod(0o755)
        self.socket = self.base / "run" / "api.sock"
        # The daemon reloads only a config no other user can change (gpushare.trust): /tmp is not.
        self.config_dir = make_trusted_dir("gs-cfg-") if trusted_base() else self.base
        self.config_path = self.config_dir / "gpushare.toml"
        self.db = self.base / "state" / "gpushare.db"
        self.extra_toml = extra_toml
        self.daemon_toml = daemon_toml  # lines for the [daemon] table
        self.inflight_library = inflight_library  # [paths] inflight_library, else the package's
        self.gpus = gpus
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        # Real cgroup v2 where the machine allows it, in a directory of this daemon's own.
        self.cgroup_dir = unique_base("gs-daemon-test") if cgroup_skip_reason() is None else None
        self.write_config(extra_toml)

    @property
    def cgroup_line(self) -> str:
        return f'cgroup_base = "{self.cgroup_dir}"' if self.cgroup_dir is not None else ""

    @property
    def library_line(self) -> str:
        lib = self.inflight_library
        return f'inflight_library = "{lib}"' if lib is not None else ""

    def config_text(self, extra_toml: str = "") -> str:
        return f"""version = 1
[paths]
runtime_dir = "{self.base}/run"
state_dir = "{self.base}/state"
socket = "{self.socket}"
{self.cgroup_line}
{self.library_line}
[daemon]
admin_group = ""
cancel_grace = "2s"
{self.daemon_toml}
[probe]
enabled = false
[metrics]
enabled = false
{extra_toml}
"""

    def write_config(self, extra_toml: str = "") -> None:
        self.config_path.write_text(self.config_text(extra_toml))

    def start(self, *, wait: bool = True) -> DaemonProc:
        env = dict(os.environ)
        env["GPUSHARE_TEST_GPUS"] = str(self.gpus)
        env.update(self.env)
        self.stderr_path = self.base / "daemon.stderr"
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.daemon_proc", str(self.config_path)],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        if wait:
            wait_for(self._answers, 15.0, f"the daemon to answer (stderr: {self.stderr_path})")
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(
                f"daemon exited {self.proc.returncode}: {self.stderr_path.read_text()[-2000:]}"
            )
        try:
            with ApiClient.connect(self.socket, timeout_s=2.0):
                return True
        except Exception:
            return False

    def api(self) -> ApiClient:
        return ApiClient.connect(self.socket, timeout_s=10.0)

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        with self.api() as api:
            return api.call(method, params)

    def client(self, client_id: str) -> dict[str, Any]:
        for c in self.call("list", {"all": True})["clients"]:
            if c["id"] == client_id:
                return c
        raise KeyError(client_id)

    def events(self) -> list[dict[str, Any]]:
        return self.call("events", {"limit": 10000})["events"]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def submit_detached(self, argv: list[str], **params: Any) -> dict[str, Any]:
        req = {
            "cls": "offline",
            "argv": argv,
            "detach": True,
            "cwd": "/",
            "env": {"PATH": os.environ["PATH"]},
        }
        req.update(params)
        return self.call("submit", req)

    def client_pids(self) -> list[tuple[int, float]]:
        if not self.db.exists():
            return []
        with contextlib.closing(sqlite3.connect(self.db)) as conn:
            return list(
                conn.execute(
                    "SELECT pid, start_time FROM clients WHERE pid IS NOT NULL AND start_time IS NOT NULL"
                )
            )

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for pid, ticks in self.client_pids():
            if is_same_process(pid, ticks):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if os.getpgid(pid) == pid:
                        os.killpg(pid, signal.SIGKILL)
                        os.killpg(pid, signal.SIGCONT)
                    else:
                        os.kill(pid, signal.SIGKILL)
        if self.cgroup_dir is not None:
            remove_tree(self.cgroup_dir)
        shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(self.config_dir, ignore_errors=True)


def duty_gpu_daemon(extra_toml: str, pauser: str) -> tuple[DaemonProc, Path]:
    """A daemon (not started) on one fake GPU whose load and memory a test sets, and that folder.

    The fake GPU is ``tests/fakes/fake_dutyprobe.py``: files in the returned folder (``burst``,
    ``mem_used``) steer it. ``pauser`` is ``cgroup`` or ``signal``.
    """
    dp = DaemonProc(
        extra_toml,
        gpus=1,
        env={"GPUSHARE_TEST_FAKE_GPU": "duty", "GPUSHARE_TEST_PAUSER": pauser},
    )
    state_dir = dp.base / "gpu"
    state_dir.mkdir()
    dp.env["GPUSHARE_TEST_STATE_DIR"] = str(state_dir)
    if pauser == "signal" and dp.cgroup_dir is not None:
        # The signal fallback must not be given a cgroup it would never create.
        dp.cgroup_dir = None
        dp.write_config(dp.extra_toml)
    return dp, state_dir


# Speaks the protocol with the standard library only, so any python the other uid can run will do.
AS_UID_SCRIPT = """
import json, socket, sys
sock, method, params = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sock)
f = s.makefile("rwb")
for i, (m, p) in enumerate([("hello", {"api_version": 1}), (method, params)]):
    f.write(json.dumps({"id": i, "method": m, "params": p}).encode() + b"\\n")
    f.flush()
    reply = json.loads(f.readline())
if "error" in reply:
    print(json.dumps({"error": reply["error"]["name"], "message": reply["error"]["message"]}))
else:
    print(json.dumps({"result": reply["result"]}))
"""


def _world_usable(path: Path) -> bool:
    path = path.resolve()
    if not path.is_file() or not os.stat(path).st_mode & 0o001:
        return False
    return all(os.stat(p).st_mode & 0o001 for p in path.parents)


def python_for_others() -> str | None:
    """A Python interpreter another uid can execute, or None."""
    for cand in (
        sys.executable,
        shutil.which("python3"),
        "/usr/bin/python3",
        "/usr/local/bin/python3",
    ):
        if cand and _world_usable(Path(cand)):
            return str(Path(cand).resolve())
    return None


def install_package_for_others(lib: Path) -> Path:
    """Copy the checkout's ``gpushare`` package under ``lib`` for other users to import; returns ``lib``.

    A test whose child runs as another user (a Slurm TaskProlog as the job's user) must not read
    the clone: root may keep it where no one else can enter (its home, a 0700 ``mktemp -d``). The
    copy is what an admin's install gives that user, a root-owned tree they can read; ``lib``'s
    parent must be such a directory (the caller creates and removes it).
    """
    target = lib / "gpushare"
    shutil.copytree(
        REPO / "gpushare", target, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    )
    for path in [lib, *lib.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return lib


# What the CLI never imports: the probe's CUDA parts (hundreds of MB).
_GPU_DISTS = frozenset({"cuda-bindings", "cuda-pathfinder", "nvidia-cuda-nvrtc-cu12"})
_SITE_FOR_OTHERS: list[Path] = []


def _dependencies(name: str, found: dict[str, importlib.metadata.Distribution]) -> None:
    key = name.lower().replace("_", "-")
    if key in found or key in _GPU_DISTS:
        return
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return
    found[key] = dist
    for req in dist.requires or []:
        if "extra ==" not in req:
            _dependencies(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0], found)


def site_for_others() -> Path:
    """A root-owned tree another user may import the gpushare CLI from, made once per session.

    The package and its run-time dependencies (without the probe's CUDA wheels), copied as an
    admin's install would give them: the clone and its virtual environment may lie where no one
    else can enter (root's home, a 0700 ``mktemp -d``). Removed when the test session ends.
    """
    if _SITE_FOR_OTHERS:
        return _SITE_FOR_OTHERS[0]
    lib = make_trusted_dir("gs-site-") / "lib"
    install_package_for_others(lib)
    found: dict[str, importlib.metadata.Distribution] = {}
    _dependencies("gpushare", found)
    found.pop("gpushare", None)
    for dist in found.values():
        for file in dist.files or []:
            src = Path(str(dist.locate_file(file)))
            if file.parts[0] == ".." or not src.is_file():
                continue  # scripts outside site-packages
            dst = lib / file
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    for path in [lib, *lib.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    atexit.register(shutil.rmtree, lib.parent, True)
    _SITE_FOR_OTHERS.append(lib)
    return lib


_LIBRARY_FOR_OTHERS: list[Path] = []


def library_for_others() -> Path | None:
    """A root-owned copy of the built in-flight library every user's job may preload; None if
    it is not built. For ``[paths] inflight_library``: the clone, where ``make native`` builds it,
    may lie where other users cannot enter (a 0700 ``mktemp -d``), and the daemon rightly refuses
    a library their jobs could not load. Made once per session, removed when it ends.
    """
    if not native.built():
        return None
    if not _LIBRARY_FOR_OTHERS:
        lib = make_trusted_dir("gs-lib-") / native.LIBRARY_NAME
        shutil.copyfile(native.library_path(), lib)
        lib.chmod(0o755)
        atexit.register(shutil.rmtree, lib.parent, True)
        _LIBRARY_FOR_OTHERS.append(lib)
    return _LIBRARY_FOR_OTHERS[0]


def call_as(uid: int, gid: int, sock: Path, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """Make one API call from a child process running as ``uid``/``gid`` (the test runs as root)."""
    python = python_for_others()
    if python is None:
        raise RuntimeError("no Python interpreter that another uid may execute")
    out = subprocess.run(
        [python, "-c", AS_UID_SCRIPT, str(sock), method, json.dumps(params)],
        cwd="/",
        user=uid,
        group=gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(out.stdout)


__all__ = [
    "ApiError",
    "DaemonProc",
    "call_as",
    "cpu_ticks",
    "install_package_for_others",
    "wait_for",
]
