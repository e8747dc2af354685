"""The daemon: its parts composed, and its own life (start, run, reload, shutdown).

A :class:`Daemon` is four objects with explicit dependencies, each in its own module:

- :class:`~gpushare.daemon.state.NodeState`: config, registry, node adapters, policy, the last
  readings and the levers (duty, offline share), and the lock every change of state takes;
- :class:`~gpushare.daemon.lifecycle.Lifecycle`: clients' processes from launch or adoption to
  exit (reap, restart, evict, recover) and the registry moves that go with them;
- :class:`~gpushare.daemon.loop.ControlLoop`: sense, decide, act every control period, and the
  offline duty cycle between ticks;
- :class:`~gpushare.daemon.api.Api`: the request handlers and who may act on which client.

Dependencies go one way: the API uses the loop (summary, readiness) and the lifecycle, the loop
uses the lifecycle, and all three read and write the shared state. API handlers run on the server's
threads, the loop on the main thread, the exit watcher on its own; the state's lock keeps them from
interleaving inside a transition.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from gpushare import __version__, native
from gpushare.config import Config
from gpushare.control.policy import Policy
from gpushare.control.registry import make_policy
from gpushare.daemon import inflight_control, launcher
from gpushare.daemon import reload as reload_mod
from gpushare.daemon.adopter import Adoptions
from gpushare.daemon.api import Api
from gpushare.daemon.freeze import STOP
from gpushare.daemon.inflight_control import ControlFiles
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.loop import ControlLoop
from gpushare.daemon.registry import Registry
from gpushare.daemon.rights import is_privileged
from gpushare.daemon.server import ApiServer, server_limits
from gpushare.daemon.state import NodeState, NoopPolicy
from gpushare.latency.app import AppLatency
from gpushare.latency.inflight import SenderLimiter
from gpushare.latency.receiver import LatencyReceiver, Sender, verified_identify
from gpushare.metrics import Exporter
from gpushare.model import ClientClass
from gpushare.node import notify as sd
from gpushare.node.base import (
    Clock,
    DaemonGpuBackend,
    DaemonMpsNode,
    LatencyProbe,
    NodePauser,
    ProcessHost,
)
from gpushare.node.clock import SystemClock
from gpushare.node.procs.host import HostProcesses

log = structlog.get_logger(__name__)

# The latency receiver and the gate timer run above the offline work they freeze: SCHED_FIFO with
# [gate] realtime_threads, else this nice value. A request start must not wait for a CPU behind
# spinning offline processes. Only root may do either; elsewhere the threads stay as they are
# (bench/gating_latency.py).
GATE_THREAD_NICE = -10
# A sender found to be no client is not looked up again for this long (see _start_latency).
_STRANGER_S = 1.0

__all__ = ["Daemon", "NoopPolicy"]


class Daemon:
    """The node daemon; :meth:`start`, then :meth:`run` until :meth:`request_stop`, then :meth:`shutdown`."""

    def __init__(
        self,
        config: Config,
        *,
        registry: Registry,
        gpu: DaemonGpuBackend,
        mps: DaemonMpsNode,
        pauser: NodePauser,
        probe: LatencyProbe | None = None,
        policy: Policy[Any] | None = None,
        config_path: Path | None = None,
        notify: Callable[..., bool] = sd.notify,
        metrics: Exporter | None = None,
        clock: Clock | None = None,
        procs: ProcessHost | None = None,
    ) -> None:
        library = native.library_path(config.paths.inflight_library)
        self.state = NodeState(
            config, registry=registry, gpu=gpu, mps=mps, pauser=pauser, probe=probe,
            policy=policy, clock=clock or SystemClock(), procs=procs or HostProcesses(),
            shallow_library=(
                str(library) if native.unusable_reason(library) is None else None
            ),
            library_vet=launcher.library_refusal,
        )  # fmt: skip
        if self.state.shallow_library is not None:
            # Issue 32: --queue auto clients switch queues live through this GPU's file.
            self.state.bound_writer = ControlFiles(
                config.paths.runtime_dir / inflight_control.SUBDIR
            )
        self.config_path = config_path
        self.metrics = metrics
        self._notify = notify
        self.lifecycle = Lifecycle(self.state)
        self.loop = ControlLoop(
            self.state, self.lifecycle, notify=notify, metrics=metrics, reload=self.reload
        )
        self.adoptions = Adoptions(self.state, self.lifecycle, config_path)
        self.api = Api(self.state, self.lifecycle, self.loop, self.adoptions)
        self._latency_rx: LatencyReceiver | None = None
        self.server: ApiServer | None = None
        self._shut_down = False

    # The adapters and the config, as the callers that build a daemon know them.

    @property
    def config(self) -> Config:
        """The config in force (replaced by :meth:`reload`)."""
        return self.state.config

    @config.setter
    def config(self, value: Config) -> None:
        self.state.config = value

    @property
    def registry(self) -> Registry:
        """The client registry."""
        return self.state.registry

    @property
    def mps(self) -> DaemonMpsNode:
        """The MPS node."""
        return self.state.mps

    @property
    def latency(self) -> AppLatency:
        """The apps' own latency reports."""
        return self.state.latency

    @property
    def ready(self) -> bool:
        """Whether READY=1 has been sent (socket bound, registry open, every MPS answering)."""
        return self.loop.ready

    # ----------------------------------------------------------------------------- life cycle

    def start(self) -> None:
        """Re-adopt recorded clients, take a first GPU sample, and open the API socket.

        Raises:
            ServerError: the socket cannot be bound.
        """
        state = self.state
        self.lifecycle.start_watching()
        state.samples = list(state.gpu.sample())
        self.lifecycle.readopt()
        self.adoptions.start()
        cfg = state.config
        self.server = ApiServer(
            cfg.paths.resolved("socket"),
            self.api.methods(),
            max_request_bytes=cfg.daemon.max_request_bytes,
            mode=int(cfg.daemon.socket_mode, 8),
            group=cfg.daemon.socket_group,
            daemon_version=__version__,
            limits=server_limits(cfg.daemon),
            privileged=lambda c: is_privileged(
                c, self.state.config.daemon.admin_group, by_membership=False
            ),
        )
        self.server.start()
        # Every thread the node's protection needs, in status and doctor (docs/security.md).
        state.threads.watch("api-io", self.server.health)
        state.threads.watch("adoption", self.adoptions.health)
        state.threads.watch("exit-watcher", state.procs.health)
        self._start_latency()
        if self.metrics is not None and cfg.metrics.enabled:
            try:
                host, port = self.metrics.serve(cfg.metrics.listen, cfg.control.period_s)
                log.info("metrics_listening", host=host, port=port)
            except OSError as exc:
                # Metrics are for dashboards; a port clash must not take the node down.
                state.registry.add_event(
                    "metrics_unavailable",
                    f"cannot serve metrics on {cfg.metrics.listen}: {exc.strerror or exc}",
                    severity="warning",
                )
        if cfg.gate.shallow_queue == "bounded" and state.shallow_library is None:
            # Shallow queues still work (blocking); the operator should know they cost more.
            library = native.library_path(cfg.paths.inflight_library)
            why = (
                f"{native.unusable_reason(library) or launcher.CANNOT_PRELOAD}: {launcher.FALLBACK}"
            )
            state.registry.add_event("shallow_queue_blocking", why, severity="warning")
            log.warning("shallow_queue_blocking", reason=why)
        if state.cordons.load_error is not None:
            state.registry.add_event(
                "drained_file_unreadable", state.cordons.load_error, severity="warning"
            )
        state.registry.add_event(
            "daemon_started", f"gpushare {__version__} started (pid {os.getpid()})"
        )
        log.info("daemon_started", pid=os.getpid(), gpus=len(state.samples))

    def _start_latency(self) -> None:
        state = self.state
        path = state.config.paths.resolved("latency_socket")
        slow = verified_identify(self.lifecycle.client_of_pid, self.lifecycle.uid_of_client)
        gate = state.gate
        strangers: dict[int | None, float] = {}

        def identify(sender: Sender) -> str | None:
            # An online client's process first, from the gates' lock-free map: a request start
            # must not wait for a tick to release the daemon's lock.
            fast = gate.client_of_pid(sender.pid) if sender.pid is not None else None
            if fast is not None:
                return fast
            # The slow path takes the daemon's lock and lists every client's processes: a process
            # found to be no client is not looked up again for a second (a flood stays cheap).
            now = time.monotonic()
            if strangers.get(sender.pid, -1.0) > now:
                return None
            found = slow(sender)
            if found is None:
                if len(strangers) > 4096:
                    strangers.clear()
                strangers[sender.pid] = now + _STRANGER_S
            return found

        rx = LatencyReceiver(
            path,
            state.latency.tracker,
            identify=identify,
            on_inflight=gate.on_inflight,
            allow=SenderLimiter(state.config.gate.max_datagrams_per_s).allow,
            reject=gate.rejections.reject,
            thread_nice=GATE_THREAD_NICE,
            thread_realtime=state.config.gate.realtime_threads,
            threads=state.threads,
            tokens=state.latency.tokens,
        )
        gate.start(thread_nice=GATE_THREAD_NICE, thread_realtime=state.config.gate.realtime_threads)
        state.threads.watch("gate-timer", gate.timer_health)
        state.gauges.start()
        try:
            rx.start()
        except OSError as exc:
            # Without it online clients' own latency is unknown; the probe still protects them.
            self.state.registry.add_event(
                "latency_socket_unavailable", str(exc), severity="warning"
            )
            return
        self._latency_rx = rx
        state.datagram_drops = lambda: dict(rx.drops)
        self.state.latency.start()

    def request_stop(self) -> None:
        """Ask the loop to stop (safe from a signal handler)."""
        self.loop.stop_requested.set()

    def request_reload(self) -> None:
        """Ask the loop to reload the config (safe from a signal handler)."""
        self.loop.reload_requested.set()

    def run(self, max_ticks: int | None = None) -> int:
        """Tick every ``control.period`` until stopped (or ``max_ticks`` ticks); returns 0."""
        return self.loop.run(max_ticks)

    def shutdown(self) -> None:
        """Stop serving and leave the workloads running (they are not the daemon's to kill)."""
        if self._shut_down:
            return
        self._shut_down = True
        state = self.state
        self._notify("STOPPING=1")
        if self.server is not None:
            self.server.close()
        self.adoptions.stop()
        # daemon.on_stop: duty-cycle and gate freezes end with the daemon ("thaw"), or every
        # offline client stays frozen until it is back ("freeze"); a user's hold stays either way.
        if state.config.daemon.on_stop == "freeze":
            self._freeze_offline_for_stop()
        else:
            self.lifecycle.release_duty_freezes()
        state.gauges.close()
        state.gate.close()
        self.lifecycle.stop_watching()
        if self.metrics is not None:
            self.metrics.close()
        if self._latency_rx is not None:
            self._latency_rx.close()
        state.latency.close()
        if state.probe is not None:
            state.probe.close()
        state.gpu.close()
        # Supervision ends with the daemon; the MPS daemons themselves keep serving the running
        # clients unless the operator asked for them to stop too.
        state.mps.stop(quit_daemon=state.config.daemon.stop_mps_on_exit)
        state.registry.add_event("daemon_stopped", "gpushare stopped; workloads left running")
        log.info("daemon_stopped")

    def _freeze_offline_for_stop(self) -> None:
        """``daemon.on_stop = "freeze"``: freeze every live offline client before the daemon stops.

        The next daemon thaws them as it re-adopts them (``Lifecycle.readopt``) and its controller
        decides from there. At the freeze arbiter the stop's own reason outlasts the gates'
        release at :meth:`shutdown`.
        """
        state = self.state
        with state.lock:
            ids = [
                r.id
                for r in state.registry.clients()
                if r.state.is_live and r.cls is ClientClass.OFFLINE and r.pid is not None
            ]
            self.lifecycle.freeze_all(ids, STOP)
            frozen = [cid for cid in ids if self.lifecycle.is_paused(cid)]
        if ids:
            state.registry.add_event(
                "offline_frozen_at_stop",
                f"{len(frozen)} of {len(ids)} offline clients stay frozen while gpushare is "
                'stopped (daemon.on_stop = "freeze")',
                severity="info" if len(frozen) == len(ids) else "warning",
            )
        log.info("offline_frozen_at_stop", clients=frozen, failed=sorted(set(ids) - set(frozen)))

    def reload(self) -> bool:
        """Re-read the config file; keep the old config with an error event if the new one is bad."""
        if self.config_path is None:
            return False
        state = self.state
        self._notify("RELOADING=1", f"MONOTONIC_USEC={int(time.monotonic() * 1e6)}")
        try:
            new = reload_mod.load_for_reload(self.config_path, state.config)
            policy = state.policy
            if new.control != state.config.control:
                policy = make_policy(new.control.policy, new.control)
        except (reload_mod.ReloadRefusedError, ValueError) as exc:
            why = f"control.policy: {exc}" if isinstance(exc, ValueError) else str(exc)
            log.error("config_reload_failed", error=why)  # noqa: TRY400 - expected, no trace
            state.registry.add_event(
                "config_reload_failed",
                f"config not reloaded, the old one stays in force: {why}",
                severity="error",
            )
            self._notify("READY=1")
            return False
        with state.lock:
            state.config = new
            # The gates read their config at each event; the rate limit and the gauge period
            # are set at start.
            state.gate.config = new.gate
            if self.server is not None:
                self.server.set_limits(server_limits(new.daemon))
            if policy is not state.policy:
                # A new policy starts from its own initial state; the duty it sends first applies.
                state.policy = policy
                self.loop.restart_policy()
        state.registry.add_event("config_reloaded", f"config reloaded from {self.config_path}")
        log.info("config_reloaded", path=str(self.config_path))
        self._notify("READY=1")
        return True
