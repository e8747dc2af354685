"""The daemon: API handlers, the run loop and the appliers of the controller's actions.

One :class:`Daemon` owns the registry, the API server and the node adapters it is given (GPU
backend, MPS node, pauser, probe, policy). The run loop senses, builds one
:class:`~gpushare.model.Observation` per shared GPU, asks the policy for actions and applies them;
between ticks it runs the offline duty cycle (see :mod:`gpushare.model`). API handlers run on the
server's threads; every change of state goes through one lock, so the loop, the handlers and the
exit watcher never interleave inside a transition.
"""

from __future__ import annotations

import grp
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import structlog

from gpushare import __version__, protocol
from gpushare import config as config_mod
from gpushare.config import Config
from gpushare.control import admission
from gpushare.control.controller import failure_backoff_s
from gpushare.control.policy import Policy
from gpushare.control.registry import make_policy
from gpushare.daemon import launcher
from gpushare.daemon.registry import ClientRecord, Registry, RegistryError, TransitionError
from gpushare.daemon.server import ApiServer, Caller
from gpushare.latency import (
    AppLatency,
    LatencyP99,
    LatencyReceiver,
    parse_latency_from,
    verified_identify,
)
from gpushare.metrics import Exporter, GpuControl, NodeMetrics
from gpushare.model import (
    Action,
    Admit,
    Alert,
    ClientClass,
    ClientState,
    ClientView,
    Evict,
    Freeze,
    GpuEvent,
    GpuSample,
    Limits,
    MpsEventKind,
    MpsState,
    Observation,
    QueuedJob,
    RecoverMps,
    RestartClient,
    SetDuty,
    SetOfflineShare,
    Thaw,
)
from gpushare.node import notify as sd
from gpushare.node import procs
from gpushare.node.base import GpuBackend, LatencyProbe, MpsNode, Pauser
from gpushare.node.cgroups import PauserError
from gpushare.observe import build_observation
from gpushare.units import format_size

log = structlog.get_logger(__name__)

S = ClientState
E = protocol.ErrorCode
_RUNNING_STATES = frozenset({S.RUNNING, S.THROTTLED, S.FROZEN})
_QUIET_MPS_EVENTS = frozenset({MpsEventKind.COMMAND, MpsEventKind.RAW})
_MAX_NAME = 64
# A pauser fails with OSError (cgroupfs, signals) or its own PauserError (timeouts, no cgroup).
_PAUSE_ERRORS = (OSError, PauserError)
# Duty steps between leaving 1 and coming back are recorded as events at most this often per GPU.
_DUTY_EVENT_INTERVAL_S = 5.0


class NoopPolicy:
    """A policy that never acts: offline work runs unthrottled. Used until a controller is wired."""

    name = "none"

    def initial_state(self, gpu_uuid: str, now: float) -> None:
        """No state."""
        return None

    def step(self, state: None, observation: Observation, now: float) -> tuple[None, list[Action]]:
        """No actions."""
        return None, []


@dataclass(frozen=True, slots=True)
class _OnExit:
    """What to do when a client's process exits, set by cancel, evict and restart."""

    kind: Literal["cancel", "evict", "requeue", "restart"]
    reason: str
    sm_pct: float | None = None


def _fail(code: protocol.ErrorCode, message: str) -> protocol.ProtocolError:
    return protocol.ProtocolError(code, message)


class Daemon:
    """The node daemon; :meth:`start`, then :meth:`run` until :meth:`request_stop`, then :meth:`shutdown`."""

    def __init__(
        self,
        config: Config,
        *,
        registry: Registry,
        gpu: GpuBackend,
        mps: MpsNode,
        pauser: Pauser,
        probe: LatencyProbe | None = None,
        policy: Policy[Any] | None = None,
        config_path: Path | None = None,
        notify: Callable[..., bool] = sd.notify,
        metrics: Exporter | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.registry = registry
        self.gpu = gpu
        self.mps = mps
        self.pauser = pauser
        self.probe = probe
        self.policy: Policy[Any] = policy if policy is not None else NoopPolicy()
        self._notify = notify
        self.metrics = metrics
        lat = config.latency
        self.latency = AppLatency(lat.window_s, lat.min_samples, lat.scrape_period_s)
        self._latency_rx: LatencyReceiver | None = None
        self._p99: dict[str, LatencyP99] = {}
        self._throttle_events: dict[str, int] = {}
        self._mps_restarts: dict[str, int] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._samples: list[GpuSample] = []
        self._policy_state: dict[str, Any] = {}
        self._duty: dict[str, float] = {}
        self._duty_event_at: dict[str, float] = {}
        self._offline_share: dict[str, float] = {}
        self._edges: dict[str, float] = {}
        self._paused: set[str] = set()
        self._by_pid: dict[int, str] = {}
        self._on_exit: dict[str, _OnExit] = {}
        self._kill_at: dict[str, float] = {}
        self._not_before: dict[str, float] = {}
        self._mps_states: dict[str, MpsState] = {}
        self._ready = False
        self._status_line = ""
        self._started_mono = time.monotonic()
        self._last_watchdog = 0.0
        self._watchdog_s = sd.watchdog_period_s()
        self.server: ApiServer | None = None
        self._watcher: procs.ExitWatcher | None = None
        self.ticks = 0
        self._shut_down = False

    # ----------------------------------------------------------------------------- life cycle

    def methods(self) -> dict[str, Callable[[Caller, dict[str, Any]], Any]]:
        """The explicit dispatch table of the API (``hello`` is answered by the server)."""
        return {
            protocol.STATUS: self.api_status,
            protocol.LIST: self.api_list,
            protocol.EVENTS: self.api_events,
            protocol.SUBMIT: self.api_submit,
            protocol.CANCEL: self.api_cancel,
            protocol.PAUSE: self.api_pause,
            protocol.RESUME: self.api_resume,
        }

    def start(self) -> None:
        """Re-adopt recorded clients, take a first GPU sample, and open the API socket.

        Raises:
            ServerError: the socket cannot be bound.
        """
        self._watcher = procs.ExitWatcher(self._process_exited).start()
        self._samples = list(self.gpu.sample())
        self.readopt()
        cfg = self.config
        self.server = ApiServer(
            cfg.paths.resolved("socket"),
            self.methods(),
            max_request_bytes=cfg.daemon.max_request_bytes,
            mode=int(cfg.daemon.socket_mode, 8),
            group=cfg.daemon.socket_group,
            daemon_version=__version__,
        )
        self.server.start()
        self._start_latency()
        if self.metrics is not None and cfg.metrics.enabled:
            try:
                host, port = self.metrics.serve(cfg.metrics.listen)
                log.info("metrics_listening", host=host, port=port)
            except OSError as exc:
                # Metrics are for dashboards; a port clash must not take the node down.
                self.registry.add_event(
                    "metrics_unavailable",
                    f"cannot serve metrics on {cfg.metrics.listen}: {exc.strerror or exc}",
                    severity="warning",
                )
        self.registry.add_event(
            "daemon_started", f"gpushare {__version__} started (pid {os.getpid()})"
        )
        log.info("daemon_started", pid=os.getpid(), gpus=len(self._samples))

    def _start_latency(self) -> None:
        path = self.config.paths.resolved("latency_socket")
        rx = LatencyReceiver(
            path,
            self.latency.tracker,
            identify=verified_identify(self._client_of_pid, self._uid_of_client),
        )
        try:
            rx.start()
        except OSError as exc:
            # Without it online clients' own latency is unknown; the probe still protects them.
            self.registry.add_event("latency_socket_unavailable", str(exc), severity="warning")
            return
        self._latency_rx = rx
        self.latency.start()

    def _client_of_pid(self, pid: int) -> str | None:
        with self._lock:
            owner = self._by_pid.get(pid)
            if owner is not None:
                return owner
            for client_id in set(self._by_pid.values()):
                if pid in self.pauser.pids(client_id):
                    return client_id
        return None

    def _uid_of_client(self, client_id: str) -> int | None:
        rec = self.registry.find(client_id)
        return rec.uid if rec is not None and rec.state.is_live else None

    def request_stop(self) -> None:
        """Ask the loop to stop (safe from a signal handler)."""
        self._stop.set()

    def request_reload(self) -> None:
        """Ask the loop to reload the config (safe from a signal handler)."""
        self._reload.set()

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested."""
        return self._stop.is_set()

    def run(self, max_ticks: int | None = None) -> int:
        """Tick every ``control.period`` until stopped (or ``max_ticks`` ticks); returns 0."""
        deadline = time.monotonic()
        ticks = 0
        while not self._stop.is_set():
            if self._reload.is_set():
                self._reload.clear()
                self.reload()
            self.tick()
            ticks += 1
            if max_ticks is not None and ticks >= max_ticks:
                break
            period = self.config.control.period_s
            deadline += period
            now = time.monotonic()
            if deadline < now:
                deadline = now  # a slow tick: do not try to catch up with a burst
            while True:
                target = min([deadline, *self._edges.values()])
                if self._stop.wait(max(0.0, target - time.monotonic())):
                    break
                if self._edges:
                    self._duty_edges(time.monotonic())
                if time.monotonic() >= deadline:
                    break
        return 0

    def shutdown(self) -> None:
        """Stop serving and leave the workloads running (they are not the daemon's to kill)."""
        if self._shut_down:
            return
        self._shut_down = True
        self._notify("STOPPING=1")
        if self.server is not None:
            self.server.close()
        with self._lock:
            # Duty-cycle freezes end with the daemon; a user's or controller's hold stays.
            for client_id in list(self._paused):
                rec = self.registry.find(client_id)
                if rec is not None and not rec.held:
                    self._set_paused(client_id, False)
        if self._watcher is not None:
            self._watcher.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self._latency_rx is not None:
            self._latency_rx.close()
        self.latency.close()
        if self.probe is not None:
            self.probe.close()
        self.gpu.close()
        # Supervision ends with the daemon; the MPS daemons themselves keep serving the running
        # clients unless the operator asked for them to stop too.
        stop = getattr(self.mps, "stop", None)
        if callable(stop):
            stop(quit_daemon=self.config.daemon.stop_mps_on_exit)
        self.registry.add_event("daemon_stopped", "gpushare stopped; workloads left running")
        log.info("daemon_stopped")

    def reload(self) -> bool:
        """Re-read the config file; keep the old config with an error event if the new one is bad."""
        if self.config_path is None:
            return False
        self._notify("RELOADING=1", f"MONOTONIC_USEC={int(time.monotonic() * 1e6)}")
        try:
            new = config_mod.load(self.config_path)
        except config_mod.ConfigError as exc:
            log.error("config_reload_failed", error=str(exc))  # noqa: TRY400 - expected, no trace
            self.registry.add_event(
                "config_reload_failed",
                f"config not reloaded, the old one stays in force: {exc}",
                severity="error",
            )
            self._notify("READY=1")
            return False
        policy = self.policy
        if new.control != self.config.control:
            try:
                policy = make_policy(new.control.policy, new.control)
            except ValueError as exc:
                self.registry.add_event(
                    "config_reload_failed",
                    f"config not reloaded, the old one stays in force: control.policy: {exc}",
                    severity="error",
                )
                self._notify("READY=1")
                return False
        if new.paths != self.config.paths:
            self.registry.add_event(
                "config_reload_partial",
                "[paths] changed: takes effect only after a restart of gpushare",
                severity="warning",
            )
            new = replace(new, paths=self.config.paths)
        with self._lock:
            self.config = new
            if policy is not self.policy:
                # A new policy starts from its own initial state; the duty it sends first applies.
                self.policy = policy
                self._policy_state.clear()
        self.registry.add_event("config_reloaded", f"config reloaded from {self.config_path}")
        log.info("config_reloaded", path=str(self.config_path))
        self._notify("READY=1")
        return True

    def readopt(self) -> None:
        """Take back every recorded live client whose process still runs; mark the rest lost."""
        assert self._watcher is not None
        with self._lock:
            for rec in self.registry.clients():
                if rec.state is S.QUEUED:
                    continue
                alive = rec.start_time is not None and rec.pid is not None
                if alive and procs.is_same_process(rec.pid or 0, rec.start_time or 0.0):
                    self._adopt_pid(
                        rec.id, rec.pid or 0, start_time=rec.start_time, owner_uid=rec.uid
                    )
                    if rec.latency_from is not None:
                        self.latency.add_prometheus(rec.id, rec.latency_from)
                    if rec.held:
                        self._set_paused(rec.id, True)
                    else:
                        # It may have been frozen by a duty cycle when the daemon died.
                        self._thaw_quietly(rec.id)
                    self.registry.add_event(
                        "client_readopted",
                        f"client {rec.id} (pid {rec.pid}) re-adopted after a daemon restart",
                        client_id=rec.id,
                        gpu_uuid=rec.gpu_uuid,
                    )
                    if rec.state is S.STARTING:
                        self.registry.transition(rec.id, S.RUNNING)
                else:
                    why = "no process was recorded" if rec.pid is None else "its process is gone"
                    self.registry.transition(
                        rec.id, S.LOST, reason=f"{why} while the daemon was down"
                    )

    def _adopt_pid(
        self,
        client_id: str,
        proc: subprocess.Popen[bytes] | int,
        start_time: float | None = None,
        *,
        owner_uid: int,
    ) -> None:
        assert self._watcher is not None
        pid = proc if isinstance(proc, int) else proc.pid
        self._by_pid[pid] = client_id
        try:
            # owner_uid: a pid handed to the daemon must never let one user freeze or kill
            # another user's process.
            self.pauser.attach(client_id, pid, owner_uid=owner_uid)
        except _PAUSE_ERRORS as exc:
            log.warning("pauser_attach_failed", client_id=client_id, pid=pid, error=str(exc))
        self._watcher.watch(proc, start_time)

    def _thaw_quietly(self, client_id: str) -> None:
        try:
            self.pauser.thaw(client_id)
        except _PAUSE_ERRORS as exc:
            log.warning("thaw_failed", client_id=client_id, error=str(exc))

    # ----------------------------------------------------------------------------- run loop

    def tick(self) -> None:
        """One control period: sense, decide per GPU, act, and report health to systemd."""
        now = time.monotonic()
        samples = list(self.gpu.sample())
        gpu_events = list(self.gpu.drain_events())
        p99 = self.latency.p99s(now)
        with self._lock:
            self._p99 = p99
            self._samples = samples
            for event in gpu_events:
                self._record_gpu_event(event)
            records = self.registry.clients()
            observations: dict[str, Observation] = {}
            for sample in samples:
                if not self._shared(sample):
                    continue
                observations[sample.uuid] = self._tick_gpu(sample, records, gpu_events, now)
            if any(r.state is S.QUEUED for r in records):
                self._admit(observations, now)
            if self.metrics is not None:
                self.metrics.update(self._metrics_snapshot(observations, records))
            self._duty_phase(now)
            self._kill_overdue(now)
            self.ticks += 1
        self._report(now)

    def _tick_gpu(
        self,
        sample: GpuSample,
        records: Sequence[ClientRecord],
        gpu_events: Sequence[GpuEvent],
        now: float,
    ) -> Observation:
        uuid = sample.uuid
        mps_state = self.mps.state(uuid)
        self._mps_states[uuid] = mps_state
        mps_events = tuple(self.mps.drain_events(uuid))
        for ev in mps_events:
            if ev.kind is MpsEventKind.DAEMON_RESTARTED:
                self._mps_restarts[uuid] = self._mps_restarts.get(uuid, 0) + 1
            if ev.kind not in _QUIET_MPS_EVENTS:
                severity = "error" if ev.kind is MpsEventKind.FATAL_EXCEPTION else "info"
                self.registry.add_event(
                    f"mps_{ev.kind.value}", ev.text, severity=severity, gpu_uuid=uuid
                )
        probe = self.probe.reading(uuid) if self.probe is not None else None
        views = tuple(self._view(rec, now) for rec in records if rec.gpu_uuid == uuid)
        obs = build_observation(
            sample=sample,
            probe=probe if self.probe is not None else None,
            clients=views,
            config=self.config,
            app_p99=self._p99,
            mps_state=mps_state,
            mps_events=mps_events,
            gpu_events=gpu_events,
            client_pids={v.client_id: self.pauser.pids(v.client_id) for v in views if v.pid},
            probe_mps_slots=1 if self.probe is not None and self.config.probe.enabled else 0,
        )
        state = self._policy_state.get(uuid)
        if uuid not in self._policy_state:
            state = self.policy.initial_state(uuid, now)
        state, actions = self.policy.step(state, obs, now)
        self._policy_state[uuid] = state
        for action in actions:
            try:
                self.apply(action, now)
            except (RegistryError, *_PAUSE_ERRORS) as exc:
                log.warning("action_failed", action=type(action).__name__, error=str(exc))
        if self.probe is not None:
            # Until the next tick. A client frozen at the last duty edge runs again in this
            # period unless the duty is 0 or it is held: "frozen right now" is not "quiet".
            duty = self._duty.get(uuid, 1.0)
            running = any(
                v.cls is ClientClass.OFFLINE
                and v.state.is_live
                and (v.client_id not in self._paused or (duty > 0.0 and not v.held))
                for v in views
            )
            self.probe.set_offline_running(uuid, running)
        return obs

    def _metrics_snapshot(
        self, observations: Mapping[str, Observation], records: Sequence[ClientRecord]
    ) -> NodeMetrics:
        control = {
            uuid: GpuControl(
                duty=self._duty.get(uuid, 1.0),
                offline_sm_pct=self._default_sm(ClientClass.OFFLINE, uuid),
                throttle_events=self._throttle_events.get(uuid, 0),
                mps_restarts=self._mps_restarts.get(uuid, 0),
            )
            for uuid in observations
        }
        names = {r.uid: r.user for r in records}
        return NodeMetrics(observations=tuple(observations.values()), control=control,
                           user_names=names)  # fmt: skip

    def _admit(self, observations: Mapping[str, Observation], now: float) -> None:
        """Start queued offline jobs where admission places them (SJF-BSBF, slots, D11)."""
        jobs = [
            QueuedJob(
                client_id=r.id,
                uid=r.uid,
                mem_bytes=r.mem_bytes,
                sm_pct=r.sm_ceiling,
                gpu=None if r.gpu_request in (None, "any") else r.gpu_request,
                submitted_at_s=now - max(0.0, time.time() - r.submitted_at),
                restartable=r.restartable,
                not_before_s=self._not_before.get(r.id, 0.0),
            )
            for r in self.registry.clients()
            if r.state is S.QUEUED
        ]
        max_clients = {s.uuid: self._max_clients(s) for s in self._samples}
        admits = admission.admit(
            jobs,
            observations,
            {u: self._default_sm(ClientClass.OFFLINE, u) for u in observations},
            now,
            max_clients=max_clients,
            multiuser={u: self._multiuser(u) for u in observations},
            probe_slots=1 if self.config.probe.enabled else 0,
        )
        for action in admits:
            try:
                self.apply(action, now)
            except (RegistryError, *_PAUSE_ERRORS) as exc:
                log.warning("admit_failed", client_id=action.client_id, error=str(exc))

    def _view(self, rec: ClientRecord, now: float) -> ClientView:
        started = None
        if rec.started_at is not None:
            started = now - max(0.0, time.time() - rec.started_at)
        return ClientView(
            client_id=rec.id,
            cls=rec.cls,
            state=rec.state,
            limits=Limits(
                sm_pct=rec.sm_pct if rec.sm_pct is not None else 100.0,
                pinned_mem_bytes=rec.mem_bytes,
                priority=rec.priority,
            ),
            uid=rec.uid,
            pid=rec.pid,
            slo_p99_ms=rec.slo_p99_ms,
            restartable=rec.restartable,
            ceiling_sm_pct=rec.sm_ceiling,
            failures=rec.failures,
            started_at_s=started,
            held=rec.held,
        )

    def _report(self, now: float) -> None:
        if not self._ready and self._all_mps_up():
            self._ready = True
            self._notify("READY=1", sd.status_field(self.summary()))
            self.registry.add_event("daemon_ready", f"ready: {self.summary()}")
            log.info("daemon_ready")
        line = self.summary()
        if line != self._status_line:
            self._status_line = line
            self._notify(sd.status_field(line))
        if self._watchdog_s is not None and now - self._last_watchdog >= self._watchdog_s:
            # Pinged only after a completed tick: a stuck loop stops the pings and systemd acts.
            self._last_watchdog = now
            self._notify("WATCHDOG=1")

    @property
    def ready(self) -> bool:
        """Whether READY=1 has been sent (socket bound, registry open, every MPS answering)."""
        return self._ready

    def _all_mps_up(self) -> bool:
        shared = [s for s in self._samples if self._shared(s)]
        return all(self._mps_states.get(s.uuid) is MpsState.UP for s in shared)

    def summary(self) -> str:
        """The one-line STATUS= summary."""
        shared = [s for s in self._samples if self._shared(s)]
        up = sum(1 for s in shared if self._mps_states.get(s.uuid) is MpsState.UP)
        recs = self.registry.clients()
        online = sum(1 for r in recs if r.cls is ClientClass.ONLINE and r.state.is_live)
        offline = sum(1 for r in recs if r.cls is ClientClass.OFFLINE and r.state.is_live)
        queued = sum(1 for r in recs if r.state is S.QUEUED)
        return (
            f"{len(shared)} GPU(s), MPS up {up}/{len(shared)}, {online} online + {offline} "
            f"offline client(s), {queued} queued"
        )

    def _record_gpu_event(self, event: GpuEvent) -> None:
        self.registry.add_event(
            "gpu_xid",
            f"XID {event.xid} on {event.gpu_uuid}" + (" (fatal)" if event.fatal else ""),
            severity="error" if event.fatal else "warning",
            gpu_uuid=event.gpu_uuid,
            data={"xid": event.xid},
        )

    # ----------------------------------------------------------------------------- duty cycle

    def _duty_phase(self, now: float) -> None:
        """Start of a period: thaw or freeze offline clients as each GPU's duty says."""
        period = self.config.control.period_s
        self._edges.clear()
        for rec in self.registry.clients():
            if rec.state not in _RUNNING_STATES or rec.pid is None:
                continue
            if rec.id in self._on_exit:
                # Cancelled or evicted: it was thawed to act on its signal; freezing it again
                # would turn a clean exit into the SIGKILL at the end of the grace.
                self._set_paused(rec.id, False)
                continue
            duty = self._duty.get(rec.gpu_uuid or "", 1.0)
            if rec.held:
                want = S.FROZEN
                self._set_paused(rec.id, True)
            elif rec.cls is ClientClass.ONLINE or duty >= 1.0:
                want = S.RUNNING
                self._set_paused(rec.id, False)
            else:
                want = S.THROTTLED
                if duty <= 0.0:
                    self._set_paused(rec.id, True)
                else:
                    self._set_paused(rec.id, False)
                    self._edges[rec.gpu_uuid or ""] = now + duty * period
            if rec.state is not want:
                why = f"offline duty {duty:g} on its GPU" if want is S.THROTTLED else None
                self._transition(rec.id, want, reason=rec.reason if want is S.FROZEN else why)

    def _duty_edges(self, now: float) -> None:
        with self._lock:
            due = [gpu for gpu, at in self._edges.items() if at <= now]
            if not due:
                return
            for gpu in due:
                del self._edges[gpu]
            ids = [
                rec.id
                for rec in self.registry.clients()
                if rec.gpu_uuid in due
                and rec.cls is ClientClass.OFFLINE
                and rec.state is S.THROTTLED
                and rec.id not in self._on_exit
                and rec.id not in self._paused
            ]
            if not ids:
                return
            # All freeze requests first, one deadline: N clients cost about one freeze latency.
            freeze_many = getattr(self.pauser, "freeze_many", None)
            if callable(freeze_many) and len(ids) > 1:
                try:
                    freeze_many(ids)
                except _PAUSE_ERRORS as exc:
                    log.warning("freeze_many_failed", clients=ids, error=str(exc))
                else:
                    self._paused.update(ids)
                    return
            for client_id in ids:
                self._set_paused(client_id, True)

    def _set_paused(self, client_id: str, paused: bool) -> None:
        try:
            if paused and client_id not in self._paused:
                self.pauser.freeze(client_id)
                self._paused.add(client_id)
            elif not paused and client_id in self._paused:
                self.pauser.thaw(client_id)
                self._paused.discard(client_id)
        except _PAUSE_ERRORS as exc:
            log.warning("pause_failed", client_id=client_id, paused=paused, error=str(exc))

    def _kill_overdue(self, now: float) -> None:
        for client_id, at in list(self._kill_at.items()):
            if now >= at:
                del self._kill_at[client_id]
                log.info("client_kill", client_id=client_id)
                try:
                    self.pauser.kill(client_id)
                except _PAUSE_ERRORS as exc:
                    log.warning("kill_failed", client_id=client_id, error=str(exc))

    def _transition(self, client_id: str, to: ClientState, **kw: Any) -> ClientRecord | None:
        try:
            return self.registry.transition(client_id, to, **kw)
        except TransitionError as exc:
            log.warning("transition_refused", client_id=client_id, to=to.value, error=str(exc))
            return None

    # ----------------------------------------------------------------------------- actions

    def apply(self, action: Action, now: float) -> None:
        """Carry out one controller action."""
        with self._lock:
            if isinstance(action, SetDuty):
                self._set_duty(action, now)
            elif isinstance(action, Freeze):
                self._hold(action.client_id, True, action.reason)
            elif isinstance(action, Thaw):
                self._hold(action.client_id, False, action.reason)
            elif isinstance(action, SetOfflineShare):
                if self._offline_share.get(action.gpu_uuid) != action.sm_pct:
                    self._offline_share[action.gpu_uuid] = action.sm_pct
                    self.registry.add_event(
                        "offline_share_changed",
                        f"offline SM share {launcher.format_pct(action.sm_pct)}%: {action.reason}",
                        gpu_uuid=action.gpu_uuid,
                    )
            elif isinstance(action, RestartClient):
                self._restart(action, now)
            elif isinstance(action, Evict):
                self._evict(action, now)
            elif isinstance(action, Admit):
                rec = self.registry.get(action.client_id)
                if rec.state is S.QUEUED:
                    self._launch_detached(rec, action.gpu_uuid, action.sm_pct, action.reason)
            elif isinstance(action, RecoverMps):
                self._recover(action, now)
            elif isinstance(action, Alert):
                self.registry.add_event(
                    "alert", action.reason, severity=action.severity.value,
                    gpu_uuid=action.gpu_uuid,
                )  # fmt: skip

    def _recover(self, action: RecoverMps, now: float) -> None:
        recs = [r for r in self.registry.clients() if r.gpu_uuid == action.gpu_uuid]
        pids = {c: [r.pid for r in recs if r.cls is c and r.pid] for c in ClientClass}
        self.registry.add_event(
            "mps_recovery", f"MPS recovery: {action.reason}", severity="warning",
            gpu_uuid=action.gpu_uuid,
        )  # fmt: skip
        # A faulted server takes no new client until every old one has exited, and
        # terminate_client ends a client's GPU work, not its process: the offline processes are
        # made to go (SIGKILL after evict_grace). The fault is not counted as their failure:
        # restartable ones go back to the queue, the others end with the recovery as reason.
        grace = self.config.control.evict_grace_s
        for rec in recs:
            if (
                rec.cls is ClientClass.OFFLINE
                and rec.state in _RUNNING_STATES
                and rec.pid is not None
                and rec.id not in self._on_exit
            ):
                requeue = rec.restartable and rec.detach
                why = f"MPS recovery: {action.reason}"
                self._on_exit[rec.id] = _OnExit("requeue" if requeue else "evict", why)
                self._set_paused(rec.id, False)
                self._kill_at[rec.id] = now + grace
        self.mps.recover(action.gpu_uuid, pids[ClientClass.OFFLINE], pids[ClientClass.ONLINE])

    def _set_duty(self, action: SetDuty, now: float) -> None:
        gpu = action.gpu_uuid
        duty = min(1.0, max(0.0, action.duty))
        old = self._duty.get(gpu, 1.0)
        self._duty[gpu] = duty
        log.info("offline_duty_set", gpu=gpu, duty=duty, previous=old, reason=action.reason)
        if duty == old:
            return
        if duty < old:
            self._throttle_events[gpu] = self._throttle_events.get(gpu, 0) + 1
        # Leaving and reaching 1 are always recorded; the steps between (several a second
        # while a burst lasts) at most once per interval, so the event log stays readable.
        if old >= 1.0:
            kind = "offline_throttled"
        elif duty >= 1.0:
            kind = "offline_released"
        elif now - self._duty_event_at.get(gpu, -math.inf) >= _DUTY_EVENT_INTERVAL_S:
            kind = "offline_duty"
        else:
            return
        self._duty_event_at[gpu] = now
        self.registry.add_event(
            kind, action.reason, gpu_uuid=gpu, data={"duty": duty, "previous": old}
        )

    def _hold(self, client_id: str, held: bool, reason: str) -> None:
        rec = self.registry.get(client_id)
        if not rec.state.is_live or rec.held == held:
            return
        self.registry.update(client_id, held=held)
        if held:
            self._set_paused(client_id, True)
            self._transition(client_id, S.FROZEN, reason=reason)
        else:
            duty = self._duty.get(rec.gpu_uuid or "", 1.0)
            offline = rec.cls is ClientClass.OFFLINE
            if not offline or duty > 0.0:
                self._set_paused(client_id, False)
            self._transition(
                client_id, S.THROTTLED if offline and duty < 1.0 else S.RUNNING, reason=reason
            )

    def _restart(self, action: RestartClient, now: float) -> None:
        rec = self.registry.get(action.client_id)
        if rec.state not in _RUNNING_STATES or not rec.restartable or rec.pid is None:
            return
        self._on_exit[rec.id] = _OnExit("restart", action.reason, action.sm_pct)
        self._set_paused(rec.id, False)
        self._signal(rec, rec.checkpoint_signal)
        self._transition(rec.id, S.RESTARTING, reason=action.reason)
        self._kill_at[rec.id] = now + self.config.daemon.cancel_grace_s

    def _evict(self, action: Evict, now: float) -> None:
        rec = self.registry.get(action.client_id)
        if rec.state not in _RUNNING_STATES or rec.pid is None or rec.gpu_uuid is None:
            return
        requeue = action.requeue and rec.restartable
        self._on_exit[rec.id] = _OnExit("requeue" if requeue else "evict", action.reason)
        self._set_paused(rec.id, False)
        # MPS forbids killing a client with GPU work in flight: terminate_client first.
        ok = self.mps.terminate_client(rec.gpu_uuid, rec.pid)
        self.registry.add_event(
            "client_evicting",
            f"evicting {rec.id}: {action.reason} (terminate_client {'ok' if ok else 'failed'})",
            severity="warning", client_id=rec.id, gpu_uuid=rec.gpu_uuid,
        )  # fmt: skip
        self._kill_at[rec.id] = now + self.config.control.evict_grace_s

    def _signal(self, rec: ClientRecord, sig: int) -> None:
        if rec.pid is None:
            return
        try:
            if os.getpgid(rec.pid) == rec.pid:
                os.killpg(rec.pid, sig)
            else:
                for pid in self.pauser.pids(rec.id) or [rec.pid]:
                    os.kill(pid, sig)
        except ProcessLookupError:
            pass

    # ----------------------------------------------------------------------------- exits

    def _process_exited(self, pid: int, code: int | None) -> None:
        with self._lock:
            client_id = self._by_pid.pop(pid, None)
            if client_id is None:
                return
            self._paused.discard(client_id)
            self._kill_at.pop(client_id, None)
            self.latency.forget(client_id)
            try:
                self.pauser.release(client_id)
            except _PAUSE_ERRORS as exc:
                log.warning("pauser_release_failed", client_id=client_id, error=str(exc))
            then = self._on_exit.pop(client_id, None)
            rec = self.registry.get(client_id)
            log.info("client_process_exited", client_id=client_id, pid=pid, exit_code=code)
            if then is not None and then.kind == "restart" and rec.gpu_uuid is not None:
                sm = then.sm_pct if then.sm_pct is not None else rec.sm_pct
                self._launch_detached(
                    rec, rec.gpu_uuid, sm, f"restarted: {then.reason}", restart=True
                )
            elif then is not None and then.kind == "requeue":
                self._transition(client_id, S.QUEUED, reason=then.reason, exit_code=code, pid=None)
            elif then is not None and then.kind == "evict":
                self._transition(
                    client_id, S.FAILED, reason=f"evicted: {then.reason}", exit_code=code
                )
            elif then is not None and then.kind == "cancel":
                self._transition(client_id, S.EXITED, reason=then.reason, exit_code=code)
            elif code is None:
                self._transition(
                    client_id, S.EXITED, reason="exit status not visible to the daemon"
                )
            elif code == 0:
                self._transition(client_id, S.EXITED, exit_code=0)
            else:
                why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                hint = procs.launch_failure(code)
                if hint:
                    why += f" (probably: {hint}; see {rec.log_path or 'its log'})"
                failures = rec.failures + 1
                control = self.config.control
                if rec.restartable and rec.detach and failures < control.max_client_failures:
                    # A restartable job goes back to the queue, after a growing backoff.
                    backoff = failure_backoff_s(failures, control)
                    self._not_before[client_id] = time.monotonic() + backoff
                    self._transition(
                        client_id, S.QUEUED, reason=f"{why}; retry in {backoff:g}s",
                        exit_code=code, failures=failures, pid=None,
                    )  # fmt: skip
                else:
                    if rec.restartable and failures >= control.max_client_failures:
                        why += f" ({failures} failures in a row: not retried)"
                    self._transition(
                        client_id, S.FAILED, reason=why, exit_code=code, failures=failures
                    )

    # ----------------------------------------------------------------------------- launching

    def _launch_detached(
        self,
        rec: ClientRecord,
        gpu_uuid: str,
        sm_pct: float | None,
        reason: str,
        *,
        restart: bool = False,
    ) -> ClientRecord:
        """STARTING, spawn and adopt, all under the caller's lock (admission, relaunch)."""
        rec = self._prepare_launch(rec, gpu_uuid, sm_pct, reason)
        return self._finish_launch(rec, self._spawn(rec), restart=restart)

    def _prepare_launch(
        self, rec: ClientRecord, gpu_uuid: str, sm_pct: float | None, reason: str
    ) -> ClientRecord:
        sample = self._sample(gpu_uuid)
        sm = sm_pct if sm_pct is not None else self._default_sm(rec.cls, gpu_uuid)
        moved = self._transition(
            rec.id, S.STARTING, reason=reason, gpu_uuid=gpu_uuid, sm_pct=sm,
            gpu_index=sample.index if sample else rec.gpu_index,
        )  # fmt: skip
        return moved or self.registry.get(rec.id)

    def _spawn(self, rec: ClientRecord) -> tuple[subprocess.Popen[bytes], float | None, Path] | str:
        """Start a STARTING client's process; the failure text instead when it cannot start.

        Needs no lock: it reads only the record, so API threads spawn in parallel.
        """
        assert rec.gpu_uuid is not None
        sm = rec.sm_pct if rec.sm_pct is not None else 100.0
        env = self._mps_env(rec.id, rec.gpu_uuid, sm, rec.mem_bytes, rec.cls)
        # With the cgroup freezer the child joins its cgroup before it execs, so a workload that
        # forks at once cannot leave a process outside the freezer's reach.
        open_fd = getattr(self.pauser, "open_procs_fd", None)
        procs_fd: int | None = None
        try:
            if callable(open_fd):
                procs_fd = open_fd(rec.id)
            return launcher.spawn_detached(
                rec.argv,
                uid=rec.uid,
                gid=rec.gid,
                cwd=rec.cwd or "/",
                env=launcher.workload_env(rec.env, env),
                log_dir=self.config.paths.resolved("client_log_dir"),
                client_id=rec.id,
                cgroup_procs_fd=procs_fd,
            )
        except (OSError, ValueError) as exc:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            return f"cannot start: {detail}"
        except _PAUSE_ERRORS as exc:
            return f"cannot start: the client's cgroup cannot be used: {exc}"
        finally:
            if procs_fd is not None:
                os.close(procs_fd)

    def _finish_launch(
        self,
        rec: ClientRecord,
        spawned: tuple[subprocess.Popen[bytes], float | None, Path] | str,
        *,
        restart: bool = False,
    ) -> ClientRecord:
        if isinstance(spawned, str):
            return self._transition(rec.id, S.FAILED, reason=spawned) or rec
        proc, start_time, log_path = spawned
        # Recorded before the exit watch: a process that is already gone is still traceable.
        self.registry.update(
            rec.id, pid=proc.pid, start_time=start_time, started_at=time.time(),
            log_path=str(log_path), pause_mechanism=self.pauser.mechanism.value,
            restarts=rec.restarts + (1 if restart else 0),
        )  # fmt: skip
        self._adopt_pid(rec.id, proc, owner_uid=rec.uid)
        current = self.registry.get(rec.id)
        if current.state is S.STARTING:  # not already ended by a prompt exit
            current = self._transition(rec.id, S.RUNNING) or current
        return current

    def _mps_env(
        self, client_id: str, gpu_uuid: str, sm: float, mem: int | None, cls: ClientClass
    ) -> dict[str, str]:
        return launcher.mps_env(
            client_id=client_id,
            limits=launcher.LaunchLimits(
                gpu_uuid=gpu_uuid, sm_pct=sm, mem_bytes=mem, priority=self._priority(cls)
            ),
            pipe_dir=self.mps.pipe_dir(gpu_uuid),
            latency_socket=self.config.paths.resolved("latency_socket"),
        )

    def _multiuser(self, gpu_uuid: str) -> bool:
        # Only the real MPS node knows whether its daemon runs -multiuser-server (DESIGN D11);
        # without that knowledge assume the stricter legacy behaviour.
        supervisor = getattr(self.mps, "supervisors", {}).get(gpu_uuid)
        return bool(getattr(supervisor, "multiuser", False))

    def _priority(self, cls: ClientClass) -> int:
        # The policy decides offline clients' MPS priority (baselines compare without it).
        if cls is ClientClass.ONLINE:
            return 0
        return int(getattr(self.policy, "offline_mps_priority", cls.mps_priority))

    def _default_sm(self, cls: ClientClass, gpu_uuid: str) -> float:
        if cls is ClientClass.ONLINE:
            return 100.0
        return self._offline_share.get(gpu_uuid, self.config.control.offline_sm_pct_default)

    def _shared(self, sample: GpuSample) -> bool:
        return self.config.gpu_override(sample.index, sample.uuid).shared

    def _sample(self, gpu_uuid: str) -> GpuSample | None:
        return next((s for s in self._samples if s.uuid == gpu_uuid), None)

    def _reserve(self, sample: GpuSample) -> int:
        override = self.config.gpu_override(sample.index, sample.uuid)
        if override.online_memory_reserve_bytes is not None:
            return override.online_memory_reserve_bytes
        return self.config.control.online_memory_reserve_bytes

    def _max_clients(self, sample: GpuSample) -> int:
        override = self.config.gpu_override(sample.index, sample.uuid)
        return override.max_clients or self.config.mps.max_clients

    # ----------------------------------------------------------------------------- API

    def _authorize(self, caller: Caller, rec: ClientRecord, what: str) -> None:
        if caller.uid in (0, rec.uid):
            return
        admin = self.config.daemon.admin_group
        if admin:
            try:
                admin_gid = grp.getgrnam(admin).gr_gid
            except KeyError:
                admin_gid = None
            if admin_gid is not None and (admin_gid == caller.gid or admin_gid in caller.groups):
                return
            if procs.user_in_group(caller.uid, admin):
                return
        raise _fail(
            E.PERMISSION_DENIED,
            f"{procs.user_name(caller.uid)} may not {what} {rec.id}, which belongs to "
            f"{rec.user}; only its owner, root or members of group {admin!r} may",
        )

    def _get(self, client_id: str) -> ClientRecord:
        rec = self.registry.find(client_id)
        if rec is None:
            raise _fail(E.NOT_FOUND, f"no client {client_id!r}; see `gpushare list --all`")
        return rec

    def api_status(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``status``: GPUs and clients (schema in docs/status-schema.md)."""
        req = protocol.from_params(protocol.StatusRequest, params)
        with self._lock:
            samples = list(self._samples)
            if req.gpu is not None:
                samples = [self._resolve_gpu(req.gpu)]
            uuids = {s.uuid for s in samples}
            recs = [r for r in self.registry.clients() if r.gpu_uuid in uuids or (
                r.state is S.QUEUED and req.gpu is None)]  # fmt: skip
            by_uuid = {s.uuid: s for s in samples}
            now = time.time()
            clients = [self._client_dict(r, by_uuid.get(r.gpu_uuid or ""), now) for r in recs]
            gpus = [self._gpu_dict(s, recs) for s in samples]
            return {
                "schema_version": protocol.STATUS_SCHEMA_VERSION,
                "daemon": {
                    "version": __version__,
                    "pid": os.getpid(),
                    "uptime_s": round(time.monotonic() - self._started_mono, 3),
                    "ready": self._ready,
                    "policy": self.policy.name,
                    "pause_mechanism": self.pauser.mechanism.value,
                    "summary": self.summary(),
                    # Optional attributes of the adapters: only the simulated node sets them.
                    "simulated": bool(getattr(self.gpu, "simulated", False)),
                },
                "gpus": gpus,
                "clients": clients,
            }

    def _gpu_dict(self, s: GpuSample, recs: Sequence[ClientRecord]) -> dict[str, Any]:
        shared = self._shared(s)
        live = [r for r in recs if r.gpu_uuid == s.uuid and r.state.is_live]
        probe_on = self.config.probe.enabled and shared
        reading = self.probe.reading(s.uuid) if self.probe is not None and shared else None
        mps_state = self._mps_states.get(s.uuid)
        online = [r for r in live if r.cls is ClientClass.ONLINE]
        ratio = reading.ratio if reading is not None else None
        # App-reported p99 against each declared SLO first; the probe speaks for the rest.
        app = [(r, self._p99.get(r.id)) for r in online if r.slo_p99_ms is not None]
        known = [(r, p.p99_ms) for r, p in app if p is not None and p.p99_ms is not None]
        violated = [r.id for r, p99 in known if p99 > (r.slo_p99_ms or math.inf)]
        slo: dict[str, Any] = {"probe_ratio": ratio, "violating_clients": violated, "reason": None}
        if not online:
            slo["state"] = "no_online_clients"
        elif violated or (ratio is not None and ratio > self.config.control.probe_slo_ratio):
            slo["state"] = "degraded"
        elif known or ratio is not None:
            slo["state"] = "ok"
        else:
            slo["state"] = "unknown"
            slo["reason"] = reading.reason if reading is not None else "probe disabled"
        return {
            "index": s.index,
            "uuid": s.uuid,
            "name": s.name,
            "shared": shared,
            "mem_total_bytes": s.mem_total_bytes,
            "mem_used_bytes": s.mem_used_bytes,
            "mem_free_bytes": s.mem_free_bytes,
            "mem_reserve_bytes": self._reserve(s),
            "gpu_util_pct": s.gpu_util_pct,
            "sm_active_pct": s.sm_active_pct,
            "mps_state": mps_state.value if mps_state is not None else None,
            "mps_backend": getattr(self.mps, "backend", None),
            "duty": self._duty.get(s.uuid, 1.0),
            "offline_sm_pct": self._default_sm(ClientClass.OFFLINE, s.uuid),
            "online_slo": slo,
            "probe": {
                "enabled": probe_on,
                "latency_ms": reading.latency_ms if reading else None,
                "baseline_ms": reading.baseline_ms if reading else None,
                "ratio": reading.ratio if reading else None,
                "reason": reading.reason if reading else "probe disabled",
            },
            "client_slots_used": len(live) + (1 if probe_on else 0),
            "client_slots_max": self._max_clients(s),
            "error": s.error,
            "lost": s.lost,
        }

    def _client_dict(self, r: ClientRecord, sample: GpuSample | None, now: float) -> dict[str, Any]:
        used = None
        if sample is not None and r.pid is not None:
            used = next((p.used_bytes for p in sample.processes if p.pid == r.pid), None)
        p99 = self._p99.get(r.id) if r.cls is ClientClass.ONLINE and r.state.is_live else None
        uptime = None
        if r.started_at is not None and r.state.is_live:
            uptime = round(now - r.started_at, 3)
        return {
            "id": r.id, "name": r.name, "user": r.user, "uid": r.uid, "class": r.cls.value,
            "gpu_uuid": r.gpu_uuid, "gpu_index": r.gpu_index, "sm_pct": r.sm_pct,
            "mem_limit_bytes": r.mem_bytes, "mem_used_bytes": used, "state": r.state.value,
            "reason": r.reason, "pid": r.pid, "uptime_s": uptime, "exit_code": r.exit_code,
            "pause_mechanism": r.pause_mechanism, "held": r.held, "restartable": r.restartable,
            "detached": r.detach, "slo_p99_ms": r.slo_p99_ms, "argv": list(r.argv),
            "log_path": r.log_path, "restarts": r.restarts, "submitted_at": r.submitted_at,
            "p99_ms": p99.p99_ms if p99 else None, "p99_samples": p99.samples if p99 else 0,
            "p99_reason": p99.reason if p99 else None,
            "started_at": r.started_at, "ended_at": r.ended_at,
        }  # fmt: skip

    def api_list(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``list``: clients (live and queued, or all)."""
        req = protocol.from_params(protocol.ListRequest, params)
        with self._lock:
            by_uuid = {s.uuid: s for s in self._samples}
            now = time.time()
            recs = self.registry.clients(include_final=req.all)
            return {
                "clients": [self._client_dict(r, by_uuid.get(r.gpu_uuid or ""), now) for r in recs]
            }

    def api_events(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``events``: the event log after ``since_id``."""
        req = protocol.from_params(protocol.EventsRequest, params)
        if req.since_id < 0 or not 1 <= req.limit <= 10_000:
            raise _fail(E.INVALID_PARAMS, "since_id must be >= 0 and limit in 1..10000")
        events = self.registry.events(req.since_id, req.limit)
        return {
            "events": [
                {
                    "id": e.id,
                    "at": e.at,
                    "kind": e.kind,
                    "severity": e.severity,
                    "client_id": e.client_id,
                    "gpu_uuid": e.gpu_uuid,
                    "message": e.message,
                }
                for e in events
            ],  # fmt: skip
            "last_id": events[-1].id if events else max(req.since_id, 0),
        }

    def api_cancel(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``cancel``: SIGTERM now, SIGKILL after ``daemon.cancel_grace``; a queued job just ends."""
        req = protocol.from_params(protocol.ClientRequest, params)
        with self._lock:
            rec = self._get(req.client_id)
            self._authorize(caller, rec, "cancel")
            who = procs.user_name(caller.uid)
            if rec.state is S.QUEUED:
                self.registry.transition(rec.id, S.EXITED, reason=f"cancelled by {who}")
                return {"client_id": rec.id, "state": S.EXITED.value, "grace_s": 0.0}
            if not rec.state.is_live or rec.pid is None:
                raise _fail(E.CONFLICT, f"client {rec.id} is {rec.state.value}; nothing to cancel")
            grace = self.config.daemon.cancel_grace_s
            self._on_exit[rec.id] = _OnExit("cancel", f"cancelled by {who}")
            # A frozen process cannot act on SIGTERM: thaw it so it can shut down cleanly.
            self._set_paused(rec.id, False)
            if rec.held:
                self._thaw_quietly(rec.id)
            self._signal(rec, signal.SIGTERM)
            self._kill_at[rec.id] = time.monotonic() + grace
            self.registry.add_event(
                "client_cancel", f"{who} cancelled {rec.id}; SIGKILL in {grace:g}s if it stays",
                client_id=rec.id, gpu_uuid=rec.gpu_uuid,
            )  # fmt: skip
            return {"client_id": rec.id, "state": rec.state.value, "grace_s": grace}

    def api_pause(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``pause``: hold a client frozen until ``resume``."""
        req = protocol.from_params(protocol.ClientRequest, params)
        with self._lock:
            rec = self._get(req.client_id)
            self._authorize(caller, rec, "pause")
            if rec.state not in _RUNNING_STATES:
                raise _fail(E.CONFLICT, f"client {rec.id} is {rec.state.value}; cannot pause it")
            self._hold(rec.id, True, f"paused by {procs.user_name(caller.uid)}")
            return {"client_id": rec.id, "state": self.registry.get(rec.id).state.value}

    def api_resume(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``resume``: release a ``pause``."""
        req = protocol.from_params(protocol.ClientRequest, params)
        with self._lock:
            rec = self._get(req.client_id)
            self._authorize(caller, rec, "resume")
            if rec.state not in _RUNNING_STATES:
                raise _fail(E.CONFLICT, f"client {rec.id} is {rec.state.value}; cannot resume it")
            self._hold(rec.id, False, f"resumed by {procs.user_name(caller.uid)}")
            return {"client_id": rec.id, "state": self.registry.get(rec.id).state.value}

    def _resolve_gpu(self, key: str) -> GpuSample:
        for s in self._samples:
            if key == s.uuid or (key.isdigit() and int(key) == s.index):
                return s
        known = ", ".join(f"{s.index} ({s.uuid})" for s in self._samples) or "none"
        raise _fail(E.NOT_FOUND, f"no GPU {key!r} on this node; GPUs: {known}")

    def api_submit(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``submit``: validate against the node, register, and adopt (foreground) or spawn."""
        req = protocol.from_params(protocol.SubmitRequest, params)
        cls = self._check_submit(req, caller)
        detach = req.detach or req.restartable
        with self._lock:
            sample, sm = self._place(req, cls, caller.uid)
            rec = self.registry.add_client(
                cls=cls, argv=req.argv, uid=caller.uid, gid=caller.gid,
                user=procs.user_name(caller.uid), state=S.STARTING, priority=self._priority(cls),
                name=req.name, gpu_request=req.gpu, gpu_uuid=sample.uuid, gpu_index=sample.index,
                sm_ceiling=req.sm_pct, sm_pct=sm,
                mem_bytes=req.mem_bytes, slo_p99_ms=req.slo_p99_ms, restartable=req.restartable,
                checkpoint_signal=req.checkpoint_signal, detach=detach,
                env=req.env if detach else {}, cwd=req.cwd,
                pause_mechanism=self.pauser.mechanism.value,
            )  # fmt: skip
            if req.latency_from is not None:
                self.registry.update(rec.id, latency_from=req.latency_from)
                self.latency.add_prometheus(rec.id, req.latency_from)
            env = self._mps_env(rec.id, sample.uuid, sm, req.mem_bytes, cls)
            if not detach:
                assert caller.pid > 0
                start_time = procs.process_start_time(caller.pid)
                self._adopt_pid(rec.id, caller.pid, start_time, owner_uid=caller.uid)
                rec = self.registry.transition(
                    rec.id, S.RUNNING, pid=caller.pid, start_time=start_time, started_at=time.time()
                )
        if detach:
            # Spawned outside the lock: concurrent submits fork in parallel; the STARTING
            # record already holds its MPS slot and memory against other submits.
            spawned = self._spawn(rec)
            with self._lock:
                rec = self._finish_launch(rec, spawned)
            if rec.state is S.FAILED and rec.pid is None:
                raise _fail(E.INVALID_PARAMS, rec.reason or "the workload could not start")
        with self._lock:
            log.info("client_submitted", client_id=rec.id, cls=cls.value, gpu=sample.uuid,
                     uid=caller.uid, detach=detach)  # fmt: skip
            result = protocol.SubmitResult(
                client_id=rec.id, gpu_uuid=sample.uuid, state=rec.state.value, env=env,
                log_path=rec.log_path, pid=rec.pid, unset_env=list(launcher.UNSET_ENV),
            )  # fmt: skip
            return protocol.as_dict(result)

    def _check_submit(self, req: protocol.SubmitRequest, caller: Caller) -> ClientClass:
        try:
            cls = ClientClass(req.cls)
        except ValueError:
            raise _fail(E.INVALID_PARAMS, "cls must be 'online' or 'offline'") from None
        if not req.argv or not req.argv[0]:
            raise _fail(E.INVALID_PARAMS, "no command given: gpushare submit ... -- CMD ARGS")
        if any("\0" in a for a in req.argv):
            raise _fail(E.INVALID_PARAMS, "arguments must not contain NUL bytes")
        if req.sm_pct is not None and not (0 < req.sm_pct <= 100 and math.isfinite(req.sm_pct)):
            raise _fail(E.INVALID_PARAMS, f"--sm must be in (0, 100], got {req.sm_pct:g}")
        if req.mem_bytes is not None and req.mem_bytes < (1 << 20):
            raise _fail(E.INVALID_PARAMS, "--mem must be at least 1M")
        if req.slo_p99_ms is not None:
            if cls is not ClientClass.ONLINE:
                raise _fail(E.INVALID_PARAMS, "--slo-p99 applies to --online clients only")
            if not (req.slo_p99_ms > 0 and math.isfinite(req.slo_p99_ms)):
                raise _fail(E.INVALID_PARAMS, "--slo-p99 must be a positive duration")
        if req.latency_from is not None:
            if cls is not ClientClass.ONLINE:
                raise _fail(E.INVALID_PARAMS, "--latency-from applies to --online clients only")
            try:
                parse_latency_from(req.latency_from)
            except ValueError as exc:
                raise _fail(E.INVALID_PARAMS, f"--latency-from: {exc}") from None
        if req.restartable and cls is not ClientClass.OFFLINE:
            raise _fail(E.INVALID_PARAMS, "--restartable applies to --offline clients only")
        if not 1 <= req.checkpoint_signal < signal.NSIG:
            raise _fail(E.INVALID_PARAMS, f"no signal number {req.checkpoint_signal}")
        if req.name is not None and (len(req.name) > _MAX_NAME or not req.name.isprintable()):
            raise _fail(E.INVALID_PARAMS, f"--name must be printable, at most {_MAX_NAME} chars")
        if req.detach or req.restartable:
            if req.cwd is None or not req.cwd.startswith("/"):
                raise _fail(E.INVALID_PARAMS, "a detached submit needs an absolute cwd")
        elif req.pid != caller.pid:
            raise _fail(
                E.INVALID_PARAMS,
                "a foreground submit must come from the process that will exec the workload "
                f"(pid {req.pid} given, the connection is pid {caller.pid})",
            )
        return cls

    def _place(
        self, req: protocol.SubmitRequest, cls: ClientClass, uid: int
    ) -> tuple[GpuSample, float]:
        """The GPU a submit goes to and its SM share; refuses what does not fit."""
        if req.gpu == "any":
            candidates = [s for s in self._samples if self._shared(s)]
            if not candidates:
                raise _fail(E.UNAVAILABLE, "no shared GPU on this node (see [gpus] in the config)")
        else:
            chosen = self._resolve_gpu(req.gpu)
            if not self._shared(chosen):
                raise _fail(
                    E.INVALID_PARAMS, f"GPU {req.gpu} is not shared by gpushare (gpus.shared)"
                )
            candidates = [chosen]
        problems: list[str] = []
        fitting: list[tuple[GpuSample, float]] = []
        for s in candidates:
            why = self._misfit(s, req, cls, uid)
            if why:
                problems.append(f"GPU {s.index}: {why}")
            else:
                sm = req.sm_pct if req.sm_pct is not None else self._default_sm(cls, s.uuid)
                fitting.append((s, sm))
        if not fitting:
            code = E.INVALID_PARAMS if any("--sm" in p for p in problems) else E.NO_CAPACITY
            if any("MPS is" in p for p in problems) and len(problems) == 1:
                code = E.UNAVAILABLE
            raise _fail(code, "; ".join(problems))
        # With several candidates, the one with the most free memory (unknown counts as least).
        return max(fitting, key=lambda f: f[0].mem_free_bytes or -1)

    def _misfit(self, s: GpuSample, req: protocol.SubmitRequest, cls: ClientClass, uid: int) -> str:
        if s.lost:
            return "the GPU is lost (see gpushare events)"
        state = self._mps_states.get(s.uuid) or self.mps.state(s.uuid)
        if state in (MpsState.FAULT, MpsState.DOWN):
            return f"MPS is {state.value} (see gpushare events)"
        override = self.config.gpu_override(s.index, s.uuid)
        top = override.offline_sm_pct_max or self.config.control.offline_sm_pct_max
        if cls is ClientClass.OFFLINE and req.sm_pct is not None and req.sm_pct > top:
            return f"--sm {req.sm_pct:g} is above this GPU's offline maximum {top:g}"
        live = sum(1 for r in self.registry.clients() if r.gpu_uuid == s.uuid and r.state.is_live)
        probe = 1 if self.config.probe.enabled else 0
        if live + probe + 1 > self._max_clients(s):
            return (
                f"all {self._max_clients(s)} MPS client slots are taken ({live} clients"
                + (" + the latency probe" if probe else "")
                + ")"
            )
        if not self._multiuser(s.uuid):
            others = sorted({r.user for r in self.registry.clients()
                             if r.gpu_uuid == s.uuid and r.state.is_live and r.uid != uid})  # fmt: skip
            if others:
                return (
                    f"MPS serves one user at a time here and {', '.join(others)} has clients "
                    "running (DESIGN D11): pick another GPU, wait, or set mps.multiuser"
                )
        free = s.mem_free_bytes
        reserve = self._reserve(s) if cls is ClientClass.OFFLINE else 0
        need = (req.mem_bytes or 0) + reserve
        if free is not None and need > free:
            kept = f" with {format_size(reserve)} kept for online clients" if reserve else ""
            return f"needs {format_size(need)}{kept}, {format_size(free)} free"
        if s.mem_total_bytes is not None and (req.mem_bytes or 0) > s.mem_total_bytes:
            return "--mem is larger than the GPU's memory"
        return ""
