"""The control loop: sense, decide, act, every control period.

:class:`ControlLoop` reads the node (GPU samples and events, MPS state and events, the probe, the
apps' own p99), builds one :class:`~gpushare.model.Observation` per shared GPU, asks the policy for
actions and applies them, admits queued jobs, and between ticks runs the offline duty cycle (see
:mod:`gpushare.model`): at the start of a period every offline client of a throttled GPU is thawed,
at ``duty x period`` it is frozen again. Launching, ending and freezing clients is the
:class:`~gpushare.daemon.lifecycle.Lifecycle`'s; the loop decides when. Time and the node come from
the :class:`~gpushare.daemon.state.NodeState` (a :class:`~gpushare.node.base.Clock` and the node
Protocols), so the simulator runs this same loop in virtual time (:mod:`gpushare.sim.runner`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from gpushare import mpsenv
from gpushare.control import admission
from gpushare.daemon.cordon import held_by_drain
from gpushare.daemon.drain import DrainTracker
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.opstats import LastAction, Tracked
from gpushare.daemon.registry import ClientRecord, RegistryError
from gpushare.daemon.state import PAUSE_ERRORS, RUNNING_STATES, NodeState
from gpushare.daemon.submitq import ForegroundWaiters, queued_jobs
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
    RecoverMps,
    RestartClient,
    SetDuty,
    SetGating,
    SetOfflineShare,
    Thaw,
)
from gpushare.node import notify as sd
from gpushare.observe import build_observation

log = structlog.get_logger(__name__)

S = ClientState
_QUIET_MPS_EVENTS = frozenset({MpsEventKind.COMMAND, MpsEventKind.RAW})
# Duty steps between leaving 1 and coming back are recorded as events at most this often per GPU.
_DUTY_EVENT_INTERVAL_S = 5.0
# A gate delay that moves by less than this factor from the one last logged at info is logged at
# debug: held to the room the SLO leaves, it creeps up a few percent every raise.
_DELAY_LOG_FACTOR = 1.25


class ControlLoop:
    """Ticks every ``control.period`` until stopped; see the module docstring."""

    def __init__(
        self,
        state: NodeState,
        lifecycle: Lifecycle,
        *,
        notify: Callable[..., bool],
        metrics: Exporter | None,
        reload: Callable[[], object],
    ) -> None:
        self.s = state
        self.life = lifecycle
        #: The submitters of queued foreground jobs (gpushare.daemon.submitq).
        self.waiters = ForegroundWaiters()
        self._notify = notify
        self.metrics = metrics
        self._reload_config = reload
        self.stop_requested = threading.Event()
        self.reload_requested = threading.Event()
        #: Each GPU's policy state (absent: the policy's initial state at the next tick).
        self.policy_state: dict[str, Any] = {}
        self._duty_event_at: dict[str, float] = {}
        #: Per GPU, the gate delay last logged at info (``gating_set``).
        self._delay_logged: dict[str, float] = {}
        #: Per GPU, the monotonic time of the coming duty edge (the freeze within the period).
        self._edges: dict[str, float] = {}
        self._throttle_events: dict[str, int] = {}
        self._mps_restarts: dict[str, int] = {}
        self.ready = False
        self._status_line = ""
        self._last_watchdog = 0.0
        self._watchdog_s = sd.watchdog_period_s()
        self.ticks = 0
        #: Actions applied so far, by kind (the simulator reports them).
        self.applied: dict[str, int] = {}
        # Each client's view and the record it was made from: the registry hands out the same
        # record object until the client changes, so an unchanged client's view is reused.
        self._views: dict[str, tuple[ClientRecord, ClientView]] = {}
        self._synced: Sequence[ClientRecord] = ()  # the records ops.sync last saw
        # Made from the records of the last tick that changed any (the registry hands out the
        # same record objects until a client changes): each GPU's client views, the clients'
        # counts for the STATUS= line, and the gates' online and gated clients (with the
        # clients told to go, which the gated exclude, as they were then).
        self._by_gpu: dict[str | None, list[ClientRecord]] = {}
        self._view_map: dict[str, ClientView] = {}
        self._gpu_views: dict[str, tuple[ClientView, ...]] = {}
        self._counts: tuple[int, int, int] = (0, 0, 0)
        self._gate_args: tuple[tuple[str, ...], dict[str, str], dict[str, list[str]]] | None = None
        #: When frozen offline clients have drained their queued kernels (probe "quiet").
        self.drain = DrainTracker()

    def run(self, max_ticks: int | None = None) -> int:
        """Tick every ``control.period`` until stopped (or ``max_ticks`` ticks); returns 0."""
        clock = self.s.clock
        deadline = clock.monotonic()
        ticks = 0
        while not self.stop_requested.is_set():
            if self.reload_requested.is_set():
                self.reload_requested.clear()
                self._reload_config()
            self.tick()
            ticks += 1
            if max_ticks is not None and ticks >= max_ticks:
                break
            deadline += self.s.config.control.period_s
            now = clock.monotonic()
            if deadline < now:
                deadline = now  # a slow tick: do not try to catch up with a burst
            if self.wait_until(deadline):
                break
        return 0

    def wait_until(self, deadline: float) -> bool:
        """Sleep until ``deadline``, freezing offline clients at their duty edges; True if stopped."""
        clock = self.s.clock
        while True:
            target = min([deadline, *self._edges.values()])
            if clock.sleep_until(target, self.stop_requested):
                return True
            if self._edges:
                self._duty_edges(clock.monotonic())
            if clock.monotonic() >= deadline:
                return False

    # ----------------------------------------------------------------------------- sense, decide

    def tick(self) -> None:
        """One control period: sense, decide per GPU, act, and report health to systemd."""
        s = self.s
        now = self.s.clock.monotonic()
        samples = list(s.gpu.sample())
        gpu_events = list(s.gpu.drain_events())
        p99 = s.latency.p99s(now)
        with s.lock:
            s.p99 = p99
            s.samples = samples
            for event in gpu_events:
                self._record_gpu_event(event)
            # A user's pause since the last tick froze a client in between: seen now.
            self._note_paused(now)
            records = s.registry.clients()
            # The registry hands out the same record objects until a client changes, and
            # ops.sync only acts on clients appearing, ending or queueing (pauses reach ops
            # from the lifecycle): with every record the one synced last tick, it has nothing
            # to do.
            synced = self._synced
            changed = len(records) != len(synced) or any(
                a is not b for a, b in zip(records, synced, strict=True)
            )
            if changed:
                s.ops.sync(self._tracked(records), now)
                self._synced = records
                self._records_changed(records, now)
            observations: dict[str, Observation] = {}
            self._update_gates(records, now, changed=changed)
            for sample in samples:
                if not s.shared(sample):
                    continue
                mine = self._gpu_views.get(sample.uuid)
                if mine is None:
                    by_gpu, views = self._by_gpu, self._view_map
                    mine = tuple(views[r.id] for r in by_gpu.get(sample.uuid, ()))
                    self._gpu_views[sample.uuid] = mine
                observations[sample.uuid] = self._tick_gpu(sample, mine, gpu_events, now)
            # Queued jobs, or admitted foreground ones not yet taken by their submitter.
            if any(r.state is S.QUEUED or (r.state is S.STARTING and r.pid is None)
                   for r in records):  # fmt: skip
                self._admit(observations, now)
            elif s.waiting:
                s.waiting = {}
            if self.metrics is not None:
                self.metrics.update(self._metrics_snapshot(observations, records))
            self._duty_phase(now)
            self._note_paused(now)
            self.drain.forget(r.id for r in records if r.state.is_live)
            self.life.kill_overdue(now)
            self.ticks += 1
            # The STATUS= line counts this tick's clients (a change made by this tick's actions
            # shows at the next tick, 100 ms on): no second read of the registry every tick.
            line = self._summary_line(self._counts)
        self._report(now, line)

    def _records_changed(self, records: Sequence[ClientRecord], now: float) -> None:
        """Remake what the tick derives from the records alone (a tick with none changed reuses it)."""
        by_gpu: dict[str | None, list[ClientRecord]] = {}
        for rec in records:
            by_gpu.setdefault(rec.gpu_uuid, []).append(rec)
        self._by_gpu = by_gpu
        self._view_map = self._views_of(records, now)
        self._gpu_views = {}
        self._counts = _count(records)
        self._gate_args = None

    def _views_of(self, records: Sequence[ClientRecord], now: float) -> dict[str, ClientView]:
        """Every client's view, made anew only for the records that changed since the last tick."""
        old = self._views
        fresh: dict[str, tuple[ClientRecord, ClientView]] = {}
        for rec in records:
            known = old.get(rec.id)
            if known is not None and known[0] is rec:
                fresh[rec.id] = known
            else:
                fresh[rec.id] = (rec, self._view(rec, now))
        self._views = fresh  # finished clients drop out with their records
        return {cid: view for cid, (_, view) in fresh.items()}

    def _tick_gpu(
        self,
        sample: GpuSample,
        views: tuple[ClientView, ...],
        gpu_events: Sequence[GpuEvent],
        now: float,
    ) -> Observation:
        s = self.s
        uuid = sample.uuid
        mps_state = s.mps.state(uuid)
        s.mps_states[uuid] = mps_state
        mps_events = tuple(s.mps.drain_events(uuid))
        for ev in mps_events:
            if ev.kind is MpsEventKind.DAEMON_RESTARTED:
                self._mps_restarts[uuid] = self._mps_restarts.get(uuid, 0) + 1
            if ev.kind not in _QUIET_MPS_EVENTS:
                severity = "error" if ev.kind is MpsEventKind.FATAL_EXCEPTION else "info"
                s.registry.add_event(
                    f"mps_{ev.kind.value}", ev.text, severity=severity, gpu_uuid=uuid
                )
        probe = s.probe.reading(uuid) if s.probe is not None else None
        obs = build_observation(
            sample=sample,
            probe=probe if s.probe is not None else None,
            clients=views,
            config=s.config,
            app_p99=s.p99,
            mps_state=mps_state,
            mps_events=mps_events,
            gpu_events=gpu_events,
            # The pids only attribute the GPU memory of the processes NVML lists: none listed,
            # nothing to attribute, and no pauser look-up per client.
            client_pids=(
                {v.client_id: s.pauser.pids(v.client_id) for v in views if v.pid}
                if sample.processes
                else {}
            ),
            probe_mps_slots=1 if s.probe is not None and s.config.probe.enabled else 0,
            # Built in, not a replace() of the observation afterwards: every GPU, every tick.
            gate=s.gate.view(uuid, now),
            time_sliced=self._time_sliced(sample),
        )
        state = self.policy_state.get(uuid)
        if uuid not in self.policy_state:
            state = s.initial_policy_state(uuid, now)
        t0 = time.perf_counter()
        state, actions = s.policy.step(state, obs, now)
        s.ops.stepped(uuid, time.perf_counter() - t0)
        self.policy_state[uuid] = state
        for action in actions:
            try:
                self.apply(action, now)
            except (RegistryError, *PAUSE_ERRORS) as exc:
                log.warning("action_failed", action=type(action).__name__, error=str(exc))
        if s.probe is not None:
            s.probe.set_offline_running(uuid, self._offline_running(sample, views, now))
        return obs

    def _offline_running(
        self, sample: GpuSample, views: tuple[ClientView, ...], now: float
    ) -> bool:
        """Whether offline work may run on the GPU until the next tick (the probe's "not quiet").

        A client frozen at the last duty edge runs again in this period unless the duty is 0 or it
        is held: "frozen right now" is not "quiet". A client frozen for good is quiet only once
        its queued kernels have drained (:mod:`gpushare.daemon.drain`).
        """
        offline = [v for v in views if v.cls is ClientClass.OFFLINE and v.state.is_live]
        if not offline:
            return False
        uuid = sample.uuid
        if sample.sm_periods:
            pids: dict[str, Sequence[int]] = {}
            # Only a period that lists a process is attributed to a client: a GPU on which
            # nothing ran costs no look-up of every offline client's processes.
            listed = any(p.pids for p in sample.sm_periods)
            for v in offline if listed else ():
                try:
                    mine = list(self.s.pauser.pids(v.client_id))
                except PAUSE_ERRORS:
                    mine = []
                pids[v.client_id] = [*mine, v.pid] if v.pid is not None else mine
            self.drain.observe(uuid, sample.sm_periods, pids)
        duty = self.s.duty.get(uuid, 1.0)
        paused = self.life.paused
        for v in offline:
            if v.client_id not in paused or (duty > 0.0 and not v.held):
                return True
            # Issue 32: kernels queued deep before a live switch drain as a deep queue's.
            shallow = v.shallow and self.life.live.settled(v.client_id, now, self.drain.deep_s)
            if not self.drain.drained(v.client_id, uuid, now, shallow=shallow):
                return True
        return False

    def _time_sliced(self, sample: GpuSample) -> bool:
        """Whether the driver time-slices the GPU's clients instead of MPS sharing it.

        In the default compute mode every process may open a context of its own, which the driver
        time-slices; the MPS supervisor puts a GPU it serves in exclusive-process mode (``[mps]
        compute_mode``), so "default" there means MPS does not hold the GPU. With ``compute_mode =
        "leave"`` the mode says nothing about MPS: time-sliced only while MPS is not up.
        """
        if sample.compute_mode != "default":
            return False
        if self.s.config.mps.compute_mode == "exclusive_process":
            return True
        return self.s.mps_states.get(sample.uuid) is not MpsState.UP

    def _update_gates(
        self, records: Sequence[ClientRecord], now: float, *, changed: bool = True
    ) -> None:
        """Tell the gates which online clients (and processes) and gated offline clients exist.

        ``changed``: whether any record changed since the last tick; when none did and no client
        was told to go since, the online and gated clients are the last tick's.
        """
        s, life = self.s, self.life
        going = tuple(life.on_exit)
        kept = self._gate_args
        if not changed and kept is not None and kept[0] == going:
            _, online, gated = kept
        else:
            online, gated = {}, {}
            for rec in records:
                if rec.gpu_uuid is None or not rec.state.is_live:
                    continue
                if rec.cls is ClientClass.ONLINE:
                    online[rec.id] = rec.gpu_uuid
                elif (
                    rec.state in RUNNING_STATES and rec.pid is not None and not life.exiting(rec.id)
                ):
                    gated.setdefault(rec.gpu_uuid, []).append(rec.id)
            self._gate_args = (going, online, gated)
        pids = {pid: cid for pid, cid in life.by_pid.items() if cid in online} if online else {}
        for cid in online:
            try:
                pids.update(dict.fromkeys(s.pauser.pids(cid), cid))
            except PAUSE_ERRORS:
                continue  # the main pid is known; a pauser that cannot list keeps that
        s.gate.update_clients(online, gated, now, pids)

    def _tracked(self, records: Sequence[ClientRecord]) -> list[Tracked]:
        wall = self.s.clock.time()
        return [
            Tracked(
                client_id=r.id,
                live=r.state.is_live and r.pid is not None,
                thawed=r.id not in self.life.paused,
                queued=r.state is S.QUEUED,
                # Never started: queued since submission; requeued: since the daemon saw it so.
                queued_since_wall_s=r.submitted_at if r.started_at is None else wall,
            )
            for r in records
        ]

    def _metrics_snapshot(
        self, observations: Mapping[str, Observation], records: Sequence[ClientRecord]
    ) -> NodeMetrics:
        ops, now = self.s.ops, self.s.clock.monotonic()
        control = {
            uuid: GpuControl(
                duty=self.s.duty.get(uuid, 1.0),
                offline_sm_pct=self.s.default_sm(ClientClass.OFFLINE, uuid),
                throttle_events=self._throttle_events.get(uuid, 0),
                mps_restarts=self._mps_restarts.get(uuid, 0),
                evictions=ops.gpu_evictions(uuid),
                step_s=ops.step_histogram(uuid),
            )
            for uuid in observations
        }
        names = {r.uid: r.user for r in records}
        clients = {
            r.id: ops.client_stats(r.id, r.name, r.restarts, now)
            for r in records
            if r.state.is_live
        }
        queued = sum(1 for r in records if r.state is S.QUEUED)
        return NodeMetrics(
            observations=tuple(observations.values()),
            control=control,
            user_names=names,
            clients=clients,
            admission=ops.admission(queued, self.s.clock.time()),
            events=self.s.registry.event_counts(),
        )

    def _admit(self, observations: Mapping[str, Observation], now: float) -> None:
        """Start queued offline jobs where admission places them (SJF-BSBF, slots, D11).

        Why each other job waits is kept for ``status`` and ``list`` (``NodeState.waiting``).
        """
        s = self.s
        records = s.registry.clients()
        for client_id in self.waiters.gone(records, now):
            # A foreground job whose submitter stopped asking (Ctrl-C, killed): it holds no place.
            self.waiters.forget(client_id)
            s.transition(client_id, S.EXITED, reason="its foreground submit stopped waiting")
        jobs = queued_jobs(records, now, s.clock.time(), self.life.not_before)
        max_clients = {x.uuid: s.max_clients(x) for x in s.samples}
        # A drained GPU (gpushare drain) starts nothing new: its jobs wait, and say why.
        drained = s.cordons.drained()
        open_gpus = {u: o for u, o in observations.items() if u not in drained}
        planned = admission.plan(
            jobs,
            open_gpus,
            {u: s.default_sm(ClientClass.OFFLINE, u) for u in observations},
            now,
            max_clients=max_clients,
            multiuser={u: s.multiuser(u) for u in observations},
            probe_slots=1 if s.config.probe.enabled else 0,
        )
        waiting = dict(planned.waiting)
        waiting.update(held_by_drain(jobs, waiting, s.samples, drained, open_gpus))
        for action in planned.admits:
            try:
                self.apply(action, now)
            except (RegistryError, *PAUSE_ERRORS) as exc:
                log.warning("admit_failed", client_id=action.client_id, error=str(exc))
                # Still queued: the next round tries again; until then, this is why.
                waiting[action.client_id] = f"admitted, but the start failed: {exc}"
        s.waiting = waiting

    def _view(self, rec: ClientRecord, now: float) -> ClientView:
        started = None
        if rec.started_at is not None:
            started = now - max(0.0, self.s.clock.time() - rec.started_at)
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
            queue=rec.queue,
            shallow=rec.id in self.life.shallow,
            live_queue=self.life.live.is_live(rec.id),  # issue 32
            restart_cost_s=rec.restart_cost_s,
            restarts=rec.restarts,
        )

    def _record_gpu_event(self, event: GpuEvent) -> None:
        self.s.registry.add_event(
            "gpu_xid",
            f"XID {event.xid} on {event.gpu_uuid}" + (" (fatal)" if event.fatal else ""),
            severity="error" if event.fatal else "warning",
            gpu_uuid=event.gpu_uuid,
            data={"xid": event.xid},
        )

    # ----------------------------------------------------------------------------- health

    def _report(self, now: float, line: str) -> None:
        if not self.ready and self._all_mps_up():
            self.ready = True
            self._notify("READY=1", sd.status_field(line))
            self.s.registry.add_event("daemon_ready", f"ready: {line}")
            log.info("daemon_ready")
        if line != self._status_line:
            self._status_line = line
            self._notify(sd.status_field(line))
        if self._watchdog_s is not None and now - self._last_watchdog >= self._watchdog_s:
            # Pinged only after a completed tick: a stuck loop stops the pings and systemd acts.
            self._last_watchdog = now
            self._notify("WATCHDOG=1")

    def _all_mps_up(self) -> bool:
        shared = [x for x in self.s.samples if self.s.shared(x)]
        return all(self.s.mps_states.get(x.uuid) is MpsState.UP for x in shared)

    def summary(self, records: Sequence[ClientRecord] | None = None) -> str:
        """The one-line STATUS= summary (of ``records``, by default the registry's clients)."""
        return self._summary_line(_count(self.s.registry.clients() if records is None else records))

    def _summary_line(self, counts: tuple[int, int, int]) -> str:
        s = self.s
        shared = [x for x in s.samples if s.shared(x)]
        up = sum(1 for x in shared if s.mps_states.get(x.uuid) is MpsState.UP)
        online, offline, queued = counts
        return (
            f"{len(shared)} GPU(s), MPS up {up}/{len(shared)}, {online} online + {offline} "
            f"offline client(s), {queued} queued"
        )

    # ----------------------------------------------------------------------------- duty cycle

    def _duty_phase(self, now: float) -> None:
        """Start of a period: thaw or freeze offline clients as each GPU's duty says."""
        life = self.life
        period = self.s.config.control.period_s
        self._edges.clear()
        # Read once this tick already with the look for other connections' commits (tick()).
        for rec in self.s.registry.clients(check=False):
            if rec.state not in RUNNING_STATES or rec.pid is None:
                continue
            if life.exiting(rec.id):
                # Cancelled or evicted: it was thawed to act on its signal; freezing it again
                # would turn a clean exit into the SIGKILL at the end of the grace.
                life.set_paused(rec.id, False)
                continue
            duty = self.s.duty.get(rec.gpu_uuid or "", 1.0)
            if rec.held:
                want = S.FROZEN
                life.set_paused(rec.id, True)
            elif rec.cls is ClientClass.ONLINE or duty >= 1.0:
                want = S.RUNNING
                life.set_paused(rec.id, False)
            else:
                want = S.THROTTLED
                if duty <= 0.0:
                    life.set_paused(rec.id, True)
                else:
                    life.set_paused(rec.id, False)
                    self._edges[rec.gpu_uuid or ""] = now + duty * period
            if rec.state is not want:
                why = f"offline duty {duty:g} on its GPU" if want is S.THROTTLED else None
                self.s.transition(rec.id, want, reason=rec.reason if want is S.FROZEN else why)

    def _duty_edges(self, now: float) -> None:
        with self.s.lock:
            due = [gpu for gpu, at in self._edges.items() if at <= now]
            if not due:
                return
            for gpu in due:
                del self._edges[gpu]
            ids = [
                rec.id
                for rec in self.s.registry.clients()
                if rec.gpu_uuid in due
                and rec.cls is ClientClass.OFFLINE
                and rec.state is S.THROTTLED
                and not self.life.exiting(rec.id)
                and rec.id not in self.life.paused
            ]
            if not ids:
                return
            self.life.freeze_all(ids)
            self._note_paused(now)

    def _note_paused(self, now: float) -> None:
        self.drain.note_paused(self.life.paused, now, self.s.clock.time())

    # ----------------------------------------------------------------------------- act

    def _delay_news(self, action: SetGating, was_on: bool) -> bool:
        """Whether a ``SetGating`` is worth an info line.

        It is when gating turned on or off, or its delay left or reached 0 or moved by
        ``_DELAY_LOG_FACTOR`` since the last such line.
        """
        last = self._delay_logged.get(action.gpu_uuid, 0.0)
        delay = action.delay_s
        news = (
            was_on != action.on
            or (delay == 0.0) != (last == 0.0)
            or (delay > 0.0 and not last / _DELAY_LOG_FACTOR < delay < last * _DELAY_LOG_FACTOR)
        )
        if news:
            self._delay_logged[action.gpu_uuid] = delay
        return news

    def apply(self, action: Action, now: float) -> None:
        """Carry out one controller action."""
        s, life = self.s, self.life
        kind = type(action).__name__
        self.applied[kind] = self.applied.get(kind, 0) + 1
        with s.lock:
            if isinstance(action, SetDuty):
                self._set_duty(action, now)
            elif isinstance(action, SetGating):
                was = s.gate.view(action.gpu_uuid, now).enabled
                s.gate.set_enabled(action.gpu_uuid, action.on, now, action.delay_s)
                life.live.gating(action.gpu_uuid, action.on, s.config.gate, now)  # issue 32
                emit = log.info if self._delay_news(action, was) else log.debug
                emit(
                    "gating_set", gpu=action.gpu_uuid, on=action.on, delay_s=action.delay_s,
                    reason=action.reason,
                )  # fmt: skip
                if was != action.on:
                    self._acted(action.gpu_uuid, "set_gating", action.reason)
                    s.registry.add_event(
                        "gating_on" if action.on else "gating_off", action.reason,
                        gpu_uuid=action.gpu_uuid,
                    )  # fmt: skip
            elif isinstance(action, Freeze | Thaw):
                held = isinstance(action, Freeze)
                rec = s.registry.find(action.client_id)
                if rec is not None and rec.state.is_live and rec.held != held:
                    self._acted_on(action.client_id, "freeze" if held else "thaw", action.reason)
                life.hold(action.client_id, held, action.reason)
            elif isinstance(action, SetOfflineShare):
                if s.offline_share.get(action.gpu_uuid) != action.sm_pct:
                    self._acted(action.gpu_uuid, "set_offline_share", action.reason)
                    s.set_offline_share(action.gpu_uuid, action.sm_pct)
                    s.registry.add_event(
                        "offline_share_changed",
                        f"offline SM share {mpsenv.format_pct(action.sm_pct)}%: {action.reason}",
                        gpu_uuid=action.gpu_uuid,
                    )
            elif isinstance(action, RestartClient):
                self._acted_on(action.client_id, "restart_client", action.reason)
                life.restart(action, now)
            elif isinstance(action, Evict):
                self._acted_on(action.client_id, "evict", action.reason)
                life.evict(action, now)
            elif isinstance(action, Admit):
                rec = s.registry.get(action.client_id)
                if rec.state is S.QUEUED and not rec.detach:
                    # Its submitter execs it: STARTING on this GPU, adopted when it asks again.
                    s.ops.admitted(rec.id, self.s.clock.time())
                    life.prepare_launch(rec, action.gpu_uuid, action.sm_pct, action.reason)
                elif rec.state is S.QUEUED:
                    s.ops.admitted(rec.id, self.s.clock.time())
                    life.launch_detached(rec, action.gpu_uuid, action.sm_pct, action.reason)
            elif isinstance(action, RecoverMps):
                self._acted(action.gpu_uuid, "recover_mps", action.reason)
                life.recover(action, now)
            elif isinstance(action, Alert):
                s.registry.add_event(
                    "alert", action.reason, severity=action.severity.value,
                    gpu_uuid=action.gpu_uuid,
                )  # fmt: skip

    def _acted(self, gpu_uuid: str, kind: str, reason: str, client_id: str | None = None) -> None:
        # What `gpushare status` gives as the GPU's "why": the last action that changed something.
        self.s.ops.acted(
            gpu_uuid,
            LastAction(kind, reason, self.s.clock.time(), self.s.clock.monotonic(), client_id),
        )

    def _acted_on(self, client_id: str, kind: str, reason: str) -> None:
        rec = self.s.registry.find(client_id)
        if rec is not None and rec.gpu_uuid is not None:
            self._acted(rec.gpu_uuid, kind, reason, client_id)

    def _set_duty(self, action: SetDuty, now: float) -> None:
        gpu = action.gpu_uuid
        duty = min(1.0, max(0.0, action.duty))
        old = self.s.duty.get(gpu, 1.0)
        self.s.duty[gpu] = duty
        log.info("offline_duty_set", gpu=gpu, duty=duty, previous=old, reason=action.reason)
        if duty == old:
            return
        self._acted(gpu, "set_duty", action.reason)
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
        self.s.registry.add_event(
            kind, action.reason, gpu_uuid=gpu, data={"duty": duty, "previous": old}
        )


def _count(records: Sequence[ClientRecord]) -> tuple[int, int, int]:
    """Online and offline live clients, and queued ones, for the STATUS= line."""
    online = offline = queued = 0
    for r in records:
        if r.state is S.QUEUED:
            queued += 1
        elif r.state.is_live:
            if r.cls is ClientClass.ONLINE:
                online += 1
            else:
                offline += 1
    return online, offline, queued
