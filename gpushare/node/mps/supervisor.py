"""The supervisor: ``nvidia-cuda-mps-control -f`` for one GPU, its events, health and restarts.

:class:`MpsSupervisor` runs the control daemon of one GPU (design D1) as the one long-running
child started with :class:`subprocess.Popen` (its output is read while it runs), turns that output
into :class:`~gpushare.model.MpsEvent` values, health-checks it, restarts it with bounded
exponential backoff, re-applies the defaults, and stops it with ``quit -t``. Recovering a faulted
server is :mod:`gpushare.node.mps.recovery`; the directories, environment and compute mode around
the daemon are :mod:`gpushare.node.mps.setup`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import structlog

from gpushare.config import Config
from gpushare.model import MpsEvent, MpsEventKind, MpsState
from gpushare.node.base import ComputeModeControl
from gpushare.node.mps.commands import (
    HEALTH_COMMAND,
    MpsControl,
    binary_refusal,
    check_device,
    check_mps_size,
    check_pct,
    check_priority,
    find_binary,
)
from gpushare.node.mps.errors import (
    CommandTimeout,
    DaemonNotReachable,
    MpsError,
    MpsSetupError,
    ServerNotFound,
)
from gpushare.node.mps.output import read_output
from gpushare.node.mps.parse import CHATTER, CHATTER_PREFIXES, event_from_line, parse_log_line
from gpushare.node.mps.recovery import FaultRecord, ServerRecovery
from gpushare.node.mps.setup import (
    ComputeModeGuard,
    daemon_env,
    decide_multiuser,
    prepare_dirs,
    remove_pipe_entries,
)

log = structlog.get_logger(__name__)

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
_SUN_PATH_MAX = 107
_EVENT_QUEUE_MAX = 4096


# --------------------------------------------------------------------------------------------
# The supervisor


EventCallback = Callable[[MpsEvent], None]


class MpsSupervisor:
    """Runs and keeps alive the MPS control daemon of one GPU (docs/design.md D1).

    Life cycle: :meth:`start` prepares the directories, sets the compute mode, starts
    ``nvidia-cuda-mps-control -f`` (or adopts a daemon already answering on the pipe directory,
    left by a previous gpushare with ``stop_mps_on_exit = false``), waits until the health command
    answers and applies the defaults. A health thread checks the daemon every ``health_period_s``
    (and at once when its output ends); a dead or silent daemon is killed, its stale pipe entries
    removed, and it is restarted with exponential backoff between ``restart_backoff_min_s`` and
    ``restart_backoff_max_s``; the defaults are re-applied and ``DAEMON_RESTARTED`` is emitted.
    :meth:`stop` sends ``quit -t``, kills the daemon if it does not exit, removes its sockets and
    restores the compute mode.
    """

    def __init__(
        self,
        gpu_uuid: str,
        config: Config,
        *,
        extra_path: Sequence[str | Path] = (),
        compute_mode: ComputeModeControl | None = None,
        pinned_limits: Mapping[int | str, int | str] | None = None,
        client_priority: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Build a stopped supervisor.

        Args:
            gpu_uuid: the GPU; its daemon gets ``CUDA_VISIBLE_DEVICES=<uuid>``.
            config: the daemon config (``paths.mps_*_dir``, ``mps.*``).
            extra_path: directories put first on the daemon's PATH (where
                ``nvidia-cuda-mps-server`` lives, when not on PATH).
            compute_mode: NVML compute-mode access; None skips compute mode with a warning.
            pinned_limits: default pinned-memory cap per device (ordinal or UUID) to apply.
            client_priority: default client priority to apply (None leaves the daemon's).
            clock: the time events are stamped with.

        Raises:
            InvalidValue: a bad pinned limit, device or priority.
            MpsSetupError: the pipe directory path is too long for a Unix socket.
        """
        self.gpu_uuid = gpu_uuid
        self.config = config
        cfg = config.mps
        self.pipe_dir = config.paths.resolved("mps_pipe_dir") / gpu_uuid
        self.log_dir = config.paths.resolved("mps_log_dir") / gpu_uuid
        longest = self.pipe_dir / "control_privileged"
        if len(os.fsencode(str(longest))) > _SUN_PATH_MAX:
            raise MpsSetupError(
                f"the MPS socket path {longest} is longer than a Unix socket allows "
                f"({_SUN_PATH_MAX} bytes); set paths.mps_pipe_dir (or paths.runtime_dir) to a shorter path"
            )
        self.control = MpsControl(
            cfg.control_binary, self.pipe_dir, timeout_s=cfg.command_timeout_s, log_dir=self.log_dir
        )
        self._extra_path = [str(p) for p in extra_path]
        self._compute_mode = ComputeModeGuard(gpu_uuid, compute_mode, log.bind(gpu=gpu_uuid))
        self._pinned = {
            check_device(d): check_mps_size(v) for d, v in (pinned_limits or {}).items()
        }
        self._priority = None if client_priority is None else check_priority(client_priority)
        self._default_pct = check_pct(cfg.default_active_thread_pct)
        self._clock = clock

        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._reader_wake: int | None = None  # write end of the reader's wake-up pipe
        self._health: threading.Thread | None = None
        self._state = MpsState.DOWN
        self._adopted = False
        self._started = False
        self._multiuser = False
        self._failures = 0
        self.restarts = 0
        self._events: collections.deque[MpsEvent] = collections.deque(maxlen=_EVENT_QUEUE_MAX)
        self._subscribers: tuple[EventCallback, ...] = ()
        #: Servers that reported a fatal exception since the last recovery (read by recover()).
        self.faults = FaultRecord()
        self._ui_reply = False
        self._reader_stop = threading.Event()
        self._log = log.bind(gpu=gpu_uuid)

    # Public view -----------------------------------------------------------------------------

    @property
    def child_pid(self) -> int | None:
        """PID of the supervised ``-f`` process (None when adopted or not running)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def multiuser(self) -> bool:
        """Whether the daemon was started with ``-multiuser-server``."""
        return self._multiuser

    def state(self) -> MpsState:
        """Health of this GPU's daemon and server."""
        fault = self.faults.any()
        state = self._state
        return MpsState.FAULT if state is MpsState.UP and fault else state

    def subscribe(self, callback: EventCallback) -> None:
        """Call ``callback`` with every event from now on (on the reader/health threads; keep it short)."""
        # Replaced, never mutated, so _emit can iterate it without a lock.
        self._subscribers = (*self._subscribers, callback)

    def drain_events(self) -> list[MpsEvent]:
        """Events since the last call (the queue keeps the newest 4096)."""
        out: list[MpsEvent] = []
        while True:
            try:
                out.append(self._events.popleft())
            except IndexError:
                return out

    # Start and stop --------------------------------------------------------------------------

    def start(self) -> None:
        """Start (or adopt) the daemon and wait until it answers; then supervise it.

        Raises:
            MpsSetupError: missing binary, ``multiuser = "on"`` unsupported, unusable directories.
            MpsError: the daemon did not answer within ``mps.ready_timeout_s``.
        """
        with self._lock:
            if self._started:
                return
            self._stop.clear()
            self._multiuser = decide_multiuser(self.config)
            prepare_dirs(self.pipe_dir, self.log_dir)
            self._compute_mode.set(self.config.mps.compute_mode)
            self._state = MpsState.STARTING
            try:
                if self._answers():
                    self._adopted = True
                    self._log.warning("mps_daemon_adopted", pipe_dir=str(self.pipe_dir))
                else:
                    self._spawn()
                    self._wait_ready()
                self._apply_defaults()
            except BaseException:
                self._kill_child()
                self._compute_mode.restore()
                self._state = MpsState.DOWN
                raise
            self._state = MpsState.UP
            self._started = True
            self._emit(MpsEvent(MpsEventKind.DAEMON_STARTED, self.gpu_uuid, self._clock(),
                                "adopted" if self._adopted else "started",
                                server_pid=None))  # fmt: skip
            self._health = threading.Thread(
                target=self._health_loop, name=f"mps-health-{self.gpu_uuid[:12]}", daemon=True
            )
            self._health.start()
        self._log.info("mps_daemon_ready", pid=self.child_pid, adopted=self._adopted,
                       multiuser=self._multiuser)  # fmt: skip

    def stop(self, *, quit_daemon: bool = True) -> None:
        """Stop supervising; with ``quit_daemon`` also stop the daemon and clean its pipe directory.

        ``quit -t <quit_timeout>`` first; the daemon is killed if it has not exited shortly after
        that timeout. Without ``quit_daemon`` the daemon keeps running for its clients and a later
        :meth:`start` adopts it.
        """
        self._stop.set()
        self._wake.set()
        health = self._health
        if health is not None and health is not threading.current_thread():
            health.join()
        with self._lock:
            if not self._started and self._proc is None:
                return
            if quit_daemon:
                self._quit_daemon()
                remove_pipe_entries(self.pipe_dir)
                self._compute_mode.restore()
            else:
                self._detach()
            self._state = MpsState.DOWN
            self._started = False
            self._adopted = False
        self._log.info("mps_daemon_stopped", quit=quit_daemon)

    # Recovery (gpushare.node.mps.recovery) ----------------------------------------------------

    def recover(
        self,
        offline_pids: Sequence[int] = (),
        online_pids: Sequence[int] = (),
        *,
        wait_s: float | None = None,
    ) -> bool:
        """Recover a faulted server: offline clients terminated first, then the rest.

        See :class:`~gpushare.node.mps.recovery.ServerRecovery` for the steps; each is logged and
        emitted as ``RECOVERY_STEP``.

        Returns:
            True when no faulted server is left.
        """
        wait = self.config.mps.ready_timeout_s if wait_s is None else wait_s
        recovery = ServerRecovery(self.control, self.faults, self._stop, self._step)
        return recovery.run(offline_pids, online_pids, wait_s=wait)

    def _step(
        self,
        step: str,
        detail: str,
        *,
        server_pid: int | None = None,
        client_pid: int | None = None,
    ) -> None:
        self._log.info("mps_recovery_step", step=step, detail=detail, server_pid=server_pid,
                       client_pid=client_pid)  # fmt: skip
        self._emit(MpsEvent(MpsEventKind.RECOVERY_STEP, self.gpu_uuid, self._clock(),
                            f"{step}: {detail}", server_pid=server_pid,
                            client_pid=client_pid))  # fmt: skip

    def server_of(self, client_pid: int) -> int | None:
        """The server a client is connected to, or None."""
        for spid in self.control.get_server_list():
            with contextlib.suppress(ServerNotFound):
                if client_pid in self.control.get_client_list(spid):
                    return spid
        return None

    # Internals: set-up -----------------------------------------------------------------------

    # Internals: the child --------------------------------------------------------------------

    def _answers(self) -> bool:
        try:
            self.control.get_default_active_thread_percentage()
        except DaemonNotReachable:
            return False
        return True

    def _spawn(self) -> None:
        prepare_dirs(
            self.pipe_dir, self.log_dir
        )  # the pipe directory may have been removed under a running daemon
        remove_pipe_entries(self.pipe_dir)  # stale sockets/FIFO of a dead daemon
        env = daemon_env(
            gpu_uuid=self.gpu_uuid,
            pipe_dir=self.pipe_dir,
            log_dir=self.log_dir,
            control_binary=self.config.mps.control_binary,
            extra_path=self._extra_path,
        )
        # Checked at every (re)start: the control daemon and the servers it starts run as root.
        why = binary_refusal(self.config.mps.control_binary, env["PATH"])
        if why is not None:
            raise MpsSetupError(f"refusing to start MPS: {why}")
        # The file just checked, not a second PATH lookup that could find another.
        found = find_binary(self.config.mps.control_binary, env["PATH"])
        argv = [found or self.config.mps.control_binary, "-f"]
        if self._multiuser:
            argv.append("-multiuser-server")
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                cwd="/",
                # Its own session: a Ctrl-C or SIGTERM to gpushare's process group must not kill MPS
                # under running clients; gpushare stops it with quit.
                start_new_session=True,
                # As before the unit's UMask=0077: MPS creates its pipes and per-user server
                # directories for clients of other users.
                umask=0o022,
            )
        except OSError as exc:
            raise MpsSetupError(
                f"cannot start {argv[0]}: {exc.strerror or exc}; install nvidia-cuda-mps or set "
                "mps.control_binary (tests: scripts/get-mps-control.sh)"
            ) from exc
        self._proc = proc
        self._adopted = False
        self._ui_reply = False
        self._reader_stop = threading.Event()
        # The reader sleeps in select() until output or this pipe: no wake-up every 100 ms.
        wake_r, self._reader_wake = os.pipe()
        assert proc.stdout is not None
        self._reader = threading.Thread(
            target=self._read_loop,
            args=(proc, proc.stdout.fileno(), self._reader_stop, wake_r),
            name=f"mps-out-{self.gpu_uuid[:12]}",
            daemon=True,
        )
        self._reader.start()
        self._log.info("mps_daemon_spawned", pid=proc.pid, argv=argv)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.mps.ready_timeout_s
        last: MpsError | None = None
        while True:
            proc = self._proc
            if proc is not None and proc.poll() is not None:
                raise DaemonNotReachable(
                    f"the MPS control daemon exited with status {proc.returncode} before answering "
                    f"(another daemon on {self.pipe_dir}? see the mps_daemon_output log lines)"
                )
            if self._started and self._stop.is_set():
                raise DaemonNotReachable("supervisor stopping")
            try:
                self.control.get_default_active_thread_percentage()
            except DaemonNotReachable as exc:
                last = exc
            else:
                return
            if time.monotonic() >= deadline:
                raise DaemonNotReachable(
                    f"the MPS control daemon on {self.pipe_dir} did not answer within "
                    f"{self.config.mps.ready_timeout_s}s: {last}"
                )
            time.sleep(0.01)

    def _apply_defaults(self) -> None:
        ctl = self.control
        ctl.set_default_active_thread_percentage(self._default_pct)
        for dev, limit in self._pinned.items():
            ctl.set_default_device_pinned_mem_limit(dev, limit)
        if self._priority is not None:
            ctl.set_default_client_priority(self._priority)
        self._log.debug("mps_defaults_applied", pct=self._default_pct, pinned=self._pinned,
                        priority=self._priority)  # fmt: skip

    def _kill_child(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._join_reader()
        self._proc = None

    def _join_reader(self) -> None:
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=5)
        self._reader = None
        wake, self._reader_wake = self._reader_wake, None
        if wake is not None:
            os.close(wake)  # the reader closes its end

    def _wake_reader(self) -> None:
        if self._reader_wake is not None:
            with contextlib.suppress(OSError):
                os.write(self._reader_wake, b"x")

    def _quit_daemon(self) -> None:
        timeout = self.config.mps.quit_timeout_s
        try:
            self.control.quit(timeout)
        except MpsError as exc:
            self._log.warning("mps_quit_failed", error=str(exc))
        proc = self._proc
        if proc is not None:
            try:
                # quit -t forces servers down after the timeout; give the daemon a moment more.
                proc.wait(timeout=timeout + 2.0)
            except subprocess.TimeoutExpired:
                self._log.warning("mps_quit_timeout_kill", pid=proc.pid)
            self._kill_child()
            if proc.returncode is not None:
                self._emit(MpsEvent(MpsEventKind.DAEMON_EXITED, self.gpu_uuid, self._clock(),
                                    "stopped", status=proc.returncode))  # fmt: skip
            return
        # An adopted daemon is not our child: wait until it stops answering.
        deadline = time.monotonic() + timeout + 2.0
        while time.monotonic() < deadline and self._answers():
            time.sleep(0.05)

    def _detach(self) -> None:
        proc = self._proc
        self._proc = None
        # Stop the reader before closing its pipe: closing a file another thread reads blocks.
        self._reader_stop.set()
        self._wake_reader()
        self._join_reader()
        if proc is not None and proc.stdout is not None:
            # The daemon survives a closed stdout (checked on R535) and goes on serving clients.
            with contextlib.suppress(OSError):
                proc.stdout.close()

    # Internals: output and events ------------------------------------------------------------

    def _read_loop(
        self, proc: subprocess.Popen[bytes], fd: int, stop: threading.Event, wake: int
    ) -> None:
        read_output(fd, stop, wake, self._handle_line)
        # EOF: the daemon exited; let the health thread look now.
        if proc is self._proc:
            self._wake.set()

    def _handle_line(self, line: str) -> None:
        text = line.rstrip("\r\n")
        if not text:
            return
        self._log.debug("mps_daemon_output", line=text)
        parsed = parse_log_line(text)
        if parsed is not None and parsed.message in CHATTER:
            self._ui_reply = False
            return
        if parsed is not None and parsed.message.startswith(CHATTER_PREFIXES):
            return
        event = event_from_line(text, self.gpu_uuid, self._clock())
        kind = event.kind
        if kind is MpsEventKind.COMMAND:
            self._ui_reply = True
            if event.text.split()[:1] == [HEALTH_COMMAND]:
                return  # the supervisor's own probe, every health period
        elif (
            kind is MpsEventKind.RAW
            and self._ui_reply
            and parsed is not None
            and parsed.component == "Control"
        ):
            return  # the reply to a front-end command, already returned to its caller
        elif kind in (MpsEventKind.DAEMON_STARTED, MpsEventKind.DAEMON_EXITED):
            return  # the supervisor emits these itself, with its own view of the process
        elif kind is MpsEventKind.FATAL_EXCEPTION:
            self.faults.mark(event.server_pid)
            self._log.error("mps_server_fault", server_pid=event.server_pid)
        self._emit(event)

    def _emit(self, event: MpsEvent) -> None:
        # No lifecycle lock here: stop() holds it while it joins the reader thread that emits.
        self._events.append(event)
        for callback in self._subscribers:
            try:
                callback(event)
            except Exception as exc:  # noqa: BLE001 - one bad subscriber must not stop the stream
                self._log.warning("mps_subscriber_failed", error=str(exc))

    # Internals: health and restart -----------------------------------------------------------

    def _backoff(self, attempt: int) -> float:
        cfg = self.config.mps
        return float(
            min(cfg.restart_backoff_max_s, cfg.restart_backoff_min_s * (2 ** min(attempt, 30)))
        )

    def _health_loop(self) -> None:
        period = self.config.mps.health_period_s
        while not self._stop.is_set():
            self._wake.wait(period)
            self._wake.clear()
            if self._stop.is_set():
                return
            reason = self._check()
            if reason is None:
                self._failures = 0
                continue
            self._restart(reason)

    def _check(self) -> str | None:
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            return f"exited with status {proc.returncode}"
        if not self._adopted and proc is None:
            return "not running"
        try:
            self.control.get_default_active_thread_percentage()
        except CommandTimeout:
            return "not answering (timeout)"
        except DaemonNotReachable as exc:
            return f"not reachable: {exc}"
        except MpsError as exc:
            # It answered, just oddly: alive.
            self._log.warning("mps_health_odd_reply", error=str(exc))
        return None

    def _restart(self, reason: str) -> None:
        self._log.error("mps_daemon_unhealthy", reason=reason, pid=self.child_pid)
        with self._lock:
            proc = self._proc
            status = proc.poll() if proc is not None else None
            self._kill_child()
            self._state = MpsState.DOWN
            self.faults.clear()
        self._emit(MpsEvent(MpsEventKind.DAEMON_EXITED, self.gpu_uuid, self._clock(), reason,
                            status=status))  # fmt: skip
        while not self._stop.is_set():
            delay = self._backoff(self._failures)
            self._failures += 1
            if self._stop.wait(delay):
                return
            with self._lock:
                if self._stop.is_set():
                    return
                self._state = MpsState.STARTING
                try:
                    self._spawn()
                    self._wait_ready()
                    self._apply_defaults()
                except MpsError as exc:
                    self._log.error("mps_restart_failed", error=str(exc), attempt=self._failures,
                                    next_delay_s=self._backoff(self._failures))  # fmt: skip
                    self._kill_child()
                    self._state = MpsState.DOWN
                    continue
                self._state = MpsState.UP
                self.restarts += 1
            self._log.warning("mps_daemon_restarted", pid=self.child_pid, reason=reason,
                              attempt=self._failures)  # fmt: skip
            self._emit(
                MpsEvent(MpsEventKind.DAEMON_RESTARTED, self.gpu_uuid, self._clock(), reason)
            )
            return
