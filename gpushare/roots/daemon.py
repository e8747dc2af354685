"""Composition root of ``gpushare daemon``: config, logging, adapters, signals, run, exit status.

Signal handlers only record (conventions rule 9): SIGTERM/SIGINT ask the loop to stop, SIGHUP asks
it to reload. The loop acts on them between ticks. A :class:`StopDeadline` makes sure a stop
happens even when the loop cannot act (a tick stuck in a simulated node, a driver call that does
not return): it hears the signal on a thread of its own, through ``signal.set_wakeup_fd`` (the
interpreter writes the signal number there at once, whatever the main thread is doing), and ends
the process :data:`STOP_DEADLINE_S` later, under the unit's ``TimeoutStopSec``, or at a second
SIGTERM/SIGINT. On stop the daemon closes its socket, leaves
every workload running (they are not its to kill; the next daemon re-adopts them) and exits 0;
it stops MPS only when ``daemon.stop_mps_on_exit`` says so, except in ``--simulate`` mode, whose
real MPS control daemons (:func:`simulated_mps`) always stop with the simulated GPUs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import structlog

from gpushare import config as config_mod
from gpushare.control.registry import make_policy
from gpushare.daemon import reload as reload_mod
from gpushare.daemon.core import Daemon
from gpushare.daemon.registry import RegistryError
from gpushare.daemon.server import ServerError
from gpushare.daemon.statedir import open_registry
from gpushare.logs import configure_logging
from gpushare.metrics import Exporter
from gpushare.model import PauseMechanism
from gpushare.node import mps as mps_mod
from gpushare.node import notify as sd
from gpushare.node.adopted import AdoptingPauser
from gpushare.node.base import DaemonMpsNode
from gpushare.node.cgroups import choice as pauser_choice
from gpushare.node.cgroups.discovery import default_base_dir, move_self_to_leaf
from gpushare.node.nvml import NvmlBackend
from gpushare.node.probe_manager import ProbeManager

if TYPE_CHECKING:
    from gpushare.sim.realtime import RealTimeSimNode

log = structlog.get_logger(__name__)


class StartupError(Exception):
    """The daemon cannot start; the message says what to fix."""


#: A stop that has not ended the process this long after SIGTERM ends it at once. Under the
#: shipped unit's TimeoutStopSec (60 s; tests/daemon/test_stop_deadline.py reads it), so
#: systemd never needs its SIGKILL, and after MPS's own stop timeouts (a clean stop takes ~1 s).
STOP_DEADLINE_S = 45.0
_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


class StopDeadline:
    """Ends the process ``deadline_s`` after a stop signal (at once after a second one)."""

    def __init__(self, deadline_s: float = STOP_DEADLINE_S) -> None:
        self.deadline_s = deadline_s
        self._done = threading.Event()
        self._fds: tuple[int, int] | None = None
        self._old_fd = -1

    def install(self) -> None:
        """Listen for stop signals (from the main thread, after their handlers are set)."""
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(write_fd, False)
        self._old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._fds = (read_fd, write_fd)
        threading.Thread(
            target=self._watch, args=(read_fd,), name="stop-deadline", daemon=True
        ).start()

    def _watch(self, read_fd: int) -> None:
        stops = 0
        due: float | None = None
        try:
            while not self._done.is_set():
                wait_s = None if due is None else max(0.0, due - time.monotonic())
                ready, _, _ = select.select([read_fd], [], [], wait_s)
                if self._done.is_set():
                    return
                if not ready:
                    self._overdue(f"still running {self.deadline_s:g} s after the stop signal")
                data = os.read(read_fd, 64)
                if not data:
                    return
                stops += sum(1 for signum in data if signum in _STOP_SIGNALS)
                if stops >= 2:
                    self._overdue("a second stop signal")
                if stops == 1 and due is None:
                    due = time.monotonic() + self.deadline_s
        finally:
            os.close(read_fd)

    def _overdue(self, why: str) -> None:
        log.error("stop_overdue", reason=why, exit_code=1)
        sys.stdout.flush()
        sys.stderr.flush()
        # Workloads keep running (they are not the daemon's to kill) and the registry's WAL is
        # safe at any point: the next start re-adopts them, as after a crash.
        os._exit(1)

    def uninstall(self) -> None:
        """The process is ending normally: stop watching."""
        self._done.set()
        if self._fds is None:
            return
        read_fd, write_fd = self._fds
        self._fds = None
        signal.set_wakeup_fd(self._old_fd)
        with contextlib.suppress(OSError):
            os.write(write_fd, b"\0")  # wakes the watcher, which closes its end
        os.close(write_fd)


def install_signals(daemon: Daemon) -> None:
    """Route SIGTERM/SIGINT to a stop request and SIGHUP to a reload request."""

    def _stop(signum: int, frame: FrameType | None) -> None:
        daemon.request_stop()

    def _reload(signum: int, frame: FrameType | None) -> None:
        daemon.request_reload()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGHUP, _reload)


def serve(daemon: Daemon) -> int:
    """Start, run until asked to stop, shut down; returns the exit status.

    Raises:
        StartupError: the socket cannot be bound.
    """
    install_signals(daemon)
    deadline = StopDeadline()
    deadline.install()
    try:
        return _serve(daemon)
    finally:
        deadline.uninstall()


def _serve(daemon: Daemon) -> int:
    try:
        daemon.start()
    except BaseException as exc:
        # As at a normal stop: supervision ends, and MPS stops where it would then (always in
        # simulate mode, where no control daemon may outlive the daemon).
        _stop_mps(daemon.mps, quit_daemon=daemon.config.daemon.stop_mps_on_exit)
        daemon.registry.close()
        if isinstance(exc, ServerError):
            raise StartupError(str(exc)) from exc
        raise
    try:
        daemon.run()
    finally:
        daemon.shutdown()
        daemon.registry.close()
    return 0


def make_pauser(cfg: config_mod.Config) -> pauser_choice.PauserChoice:
    """The cgroup freezer where cgroup v2 is writable (the daemon moved into its leaf), else signals."""
    base = cfg.paths.cgroup_base
    choice = pauser_choice.make_pauser(base)
    if choice.pauser.mechanism is PauseMechanism.CGROUP:
        leaf_base = base if base is not None else default_base_dir()
        if leaf_base is not None:
            # cgroup v2's no-internal-processes rule: the daemon leaves the clients' parent.
            move_self_to_leaf(leaf_base)
    return choice


def build(cfg: config_mod.Config, config_path: Path | None) -> Daemon:
    """Wire the real node adapters into a :class:`Daemon`.

    Raises:
        StartupError: an adapter or the registry cannot be set up.
    """
    try:
        registry = open_registry(cfg)
    except RegistryError as exc:
        raise StartupError(str(exc)) from exc
    gpu = NvmlBackend()
    shared = [s.uuid for s in gpu.sample() if cfg.for_gpu(s.index, s.uuid).shared]
    # NVML sets EXCLUSIVE_PROCESS on each shared GPU while MPS runs (mps.compute_mode).
    mps = mps_mod.MpsNodeManager(cfg, shared, compute_mode=gpu)
    try:
        mps.start()
    except mps_mod.MpsError as exc:
        registry.close()
        raise StartupError(f"MPS: {exc}") from exc
    probe = None
    if cfg.probe.enabled:
        probe = ProbeManager(cfg.probe)
        for uuid in shared:
            # The probe is an MPS client of its GPU like any workload, at normal priority.
            probe.start(
                uuid,
                {
                    **sd.clean_env(os.environ),
                    "CUDA_MPS_PIPE_DIRECTORY": str(mps.pipe_dir(uuid)),
                    "CUDA_MPS_LOG_DIRECTORY": str(cfg.paths.resolved("mps_log_dir") / uuid),
                },
            )
    try:
        policy = make_policy(cfg.control.policy, cfg.control)
    except ValueError as exc:
        registry.close()
        raise StartupError(f"control.policy: {exc}") from exc
    pauser = make_pauser(cfg)
    log.info("pause_mechanism", mechanism=pauser.pauser.mechanism.value, reason=pauser.reason)
    return Daemon(
        cfg,
        registry=registry,
        gpu=gpu,
        mps=mps,
        # Launched clients go to their own cgroup (or group); adopted ones are paused where they are.
        pauser=AdoptingPauser(pauser.pauser),
        probe=probe,
        policy=policy,
        config_path=config_path,
        metrics=Exporter() if cfg.metrics.enabled else None,
    )


def _serving(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _stop_mps(mps: DaemonMpsNode, *, quit_daemon: bool) -> None:
    mps.stop(quit_daemon=quit_daemon)


def simulated_mps(
    cfg: config_mod.Config, rt: RealTimeSimNode
) -> tuple[DaemonMpsNode, dict[str, str]]:
    """The MPS of the simulated node: real control daemons when the binary is installed.

    The binary is looked up as the real daemon and ``gpushare doctor`` do (``mps.control_binary``,
    a name on PATH or an absolute path). Found: one real control daemon per simulated GPU,
    started and supervised by :class:`~gpushare.node.mps.MpsNodeManager` under
    ``paths.mps_pipe_dir``/``paths.mps_log_dir``, joined with the simulated MPS
    (:class:`~gpushare.sim.hybrid_mps.HybridMpsNode`). Not found: the simulated MPS alone. Also
    returns what to log about the choice.

    Raises:
        StartupError: the binary is installed but does not run, or its daemons do not start:
            a simulate run that silently fell back would hide a broken MPS set-up.
    """
    from gpushare.sim.hybrid_mps import HybridMpsNode

    name = cfg.mps.control_binary
    if mps_mod.find_binary(name) is None:
        reason = (
            f"{name} not found; install it (Debian/Ubuntu: apt-get install nvidia-cuda-mps; "
            "a clone: scripts/get-mps-control.sh) or set mps.control_binary"
        )
        return rt.mps_node(), {"mps": "simulated", "reason": reason}
    sock = cfg.paths.resolved("socket")
    if _serving(sock):
        # Its control daemons would be adopted here and quit at this daemon's failed start.
        raise StartupError(f"another gpushare daemon is serving {sock}; stop it first")
    ok, path, hint = mps_mod.binary_status(name)
    if not ok:
        raise StartupError(
            f"MPS: {path}; {hint or 'reinstall it'} (or set mps.control_binary to a name that is "
            "not installed to simulate MPS)"
        )
    # Simulated GPUs have no NVML: no compute mode to set, and nothing to warn about.
    mps_cfg = dataclasses.replace(cfg, mps=dataclasses.replace(cfg.mps, compute_mode="leave"))
    try:
        manager = mps_mod.MpsNodeManager(mps_cfg, rt.gpu_uuids)
        node = HybridMpsNode(manager, rt.mps_node())
        node.start()
    except mps_mod.MpsError as exc:
        raise StartupError(
            f"MPS ({path}, simulate mode): {exc} (or set mps.control_binary to a name that is not "
            "installed to simulate MPS)"
        ) from exc
    return node, {
        "mps": "real",
        "binary": path,
        "version": mps_mod.binary_version(path) or "unknown",
    }


def build_simulated(cfg: config_mod.Config, config_path: Path | None, gpus: int) -> Daemon:
    """Wire the real daemon to ``gpus`` simulated GPUs running in real time (docs/design.md D10).

    MPS is real where its control binary is installed (:func:`simulated_mps`).

    Raises:
        StartupError: the registry cannot be opened, the policy is unknown, or the installed MPS
            control daemons cannot be started.
    """
    from gpushare.sim.daemon_node import SimClientInfo, SimulatedPauser
    from gpushare.sim.realtime import RealTimeSimNode

    try:
        registry = open_registry(cfg)
    except RegistryError as exc:
        raise StartupError(str(exc)) from exc
    try:
        policy = make_policy(cfg.control.policy, cfg.control)
    except ValueError as exc:
        registry.close()
        raise StartupError(f"control.policy: {exc}") from exc
    rt = RealTimeSimNode(gpus, cfg, runtime_dir=cfg.paths.runtime_dir)

    def lookup(client_id: str) -> SimClientInfo | None:
        try:
            rec = registry.get(client_id)
        except RegistryError:
            return None
        if rec.gpu_uuid is None:
            return None
        return SimClientInfo(
            cls=rec.cls,
            gpu_uuid=rec.gpu_uuid,
            sm_pct=rec.sm_pct if rec.sm_pct is not None else 100.0,
            mem_bytes=rec.mem_bytes,
            slo_p99_ms=rec.slo_p99_ms,
            restartable=rec.restartable,
            env=rec.env,
        )

    real = make_pauser(cfg)
    try:
        mps, mps_info = simulated_mps(cfg, rt)
    except StartupError:
        registry.close()
        raise
    log.info("simulated_node", gpus=gpus, uuids=rt.gpu_uuids, mechanism=real.pauser.mechanism.value,
             **mps_info)  # fmt: skip
    try:
        daemon = Daemon(
            cfg,
            registry=registry,
            gpu=rt.gpu_backend(),
            mps=mps,
            pauser=SimulatedPauser(AdoptingPauser(real.pauser), rt, lookup),
            probe=rt.latency_probe() if cfg.probe.enabled else None,
            policy=policy,
            config_path=config_path,
            metrics=Exporter() if cfg.metrics.enabled else None,
        )
    except BaseException:
        _stop_mps(mps, quit_daemon=True)
        registry.close()
        raise
    # Simulated services report their request latencies as real ones would (report_latency).
    rt.on_latency = daemon.latency.tracker.add
    # ... and their request boundaries, as request_started/request_ended would (request gating).
    gate = daemon.state.gate

    def boundary(client_id: str, pid: int, count: int, at_s: float) -> None:
        why = gate.on_inflight(client_id, pid, count, at_s)
        if why is not None:
            gate.rejections.reject(why, client_id=client_id, pid=pid)

    rt.start_boundaries(boundary)
    return daemon


def main(config_path: Path, log_level: str | None = None, simulate: int | None = None) -> int:
    """Entry point of ``gpushare daemon``; returns the process exit status.

    ``simulate``: run on that many simulated GPUs in real time instead of the host's.
    """
    try:
        cfg = config_mod.load(config_path)
    except config_mod.ConfigError as exc:
        print(f"gpushare: {exc}", file=sys.stderr)
        return 2
    # Also simulated: the config still says where root writes and which clients it starts.
    untrusted = reload_mod.untrusted_config(config_path)
    if untrusted is not None:
        print(f"gpushare: {untrusted}", file=sys.stderr)
        return 2
    configure_logging(log_level or cfg.daemon.log_level)
    try:
        if simulate is not None:
            return serve(build_simulated(cfg, config_path, simulate))
        return serve(build(cfg, config_path))
    except StartupError as exc:
        log.error("daemon_start_failed", error=str(exc))  # noqa: TRY400 - the message is the fix
        print(f"gpushare: {exc}", file=sys.stderr)
        return 1
