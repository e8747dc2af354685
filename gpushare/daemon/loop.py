"""The control loop: sense, decide, act, every control period.

:class:`ControlLoop` runs one tick per control period as a pipeline of small parts, each with
one job, all handed the tick's one reading of the clock (:class:`~gpushare.daemon.tick.Tick`):

1. read the GPUs and the apps' own p99, and take the registry's records
   (:class:`~gpushare.daemon.clientviews.ClientViews` keeps each client's view);
2. tell the request gates which clients exist (:class:`~gpushare.daemon.gatefeed.GateFeed`);
3. per shared GPU, sense it into an :class:`~gpushare.model.Observation`
   (:func:`~gpushare.daemon.sensing.observe_gpu`, around the pure
   :func:`~gpushare.daemon.observe.build_observation`), step the policy, and carry out its actions
   (:class:`~gpushare.daemon.actuator.Actuator`, one handler per action type);
4. admit queued jobs (:func:`gpushare.control.admission.plan`);
5. start the offline duty period (:class:`~gpushare.daemon.dutycycle.DutyCycle`), whose edges
   freeze offline clients again between ticks;
6. report health and metrics (:class:`~gpushare.daemon.reporter.Reporter`).

Launching, ending and freezing clients is the :class:`~gpushare.daemon.lifecycle.Lifecycle`'s;
the loop decides when. Time and the node come from the
:class:`~gpushare.daemon.state.NodeState` (a :class:`~gpushare.node.base.Clock` and the node
Protocols), so the simulator runs this same loop in virtual time (:mod:`gpushare.sim.runner`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from gpushare.control import admission
from gpushare.daemon import startcost
from gpushare.daemon.actuator import Actuator
from gpushare.daemon.clientviews import ClientViews
from gpushare.daemon.cordon import held_by_drain
from gpushare.daemon.drain import DrainTracker
from gpushare.daemon.dutycycle import DutyCycle
from gpushare.daemon.gatefeed import GateFeed
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.opstats import Tracked
from gpushare.daemon.registry import ClientRecord, RegistryError
from gpushare.daemon.reporter import Reporter
from gpushare.daemon.sensing import observe_gpu, record_gpu_event
from gpushare.daemon.state import PAUSE_ERRORS, NodeState
from gpushare.daemon.submitq import ForegroundWaiters, queued_jobs
from gpushare.daemon.tick import Tick
from gpushare.metrics import Exporter
from gpushare.model import (
    Action,
    ClientClass,
    ClientState,
    ClientView,
    GpuEvent,
    GpuSample,
    Observation,
)

log = structlog.get_logger(__name__)

S = ClientState


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
        self._reload_config = reload
        self.stop_requested = threading.Event()
        self.reload_requested = threading.Event()
        #: Each GPU's policy state (absent: the policy's initial state at the next tick).
        self.policy_state: dict[str, Any] = {}
        self.ticks = 0
        self.reporter = Reporter(state, notify=notify, metrics=metrics)
        self.actuator = Actuator(state, lifecycle, self.reporter)
        self.views = ClientViews(lifecycle)
        self.gates = GateFeed(state, lifecycle)
        self.duty = DutyCycle(state, lifecycle)

    # The parts' figures, as callers of the loop know them.

    @property
    def ready(self) -> bool:
        """Whether READY=1 has been sent."""
        return self.reporter.ready

    @property
    def applied(self) -> dict[str, int]:
        """Actions applied so far, by kind (the simulator reports them)."""
        return self.actuator.applied

    @property
    def drain(self) -> DrainTracker:
        """When frozen offline clients have drained their queued kernels (probe "quiet")."""
        return self.duty.drain

    def summary(self, records: Sequence[ClientRecord] | None = None) -> str:
        """The one-line STATUS= summary (of ``records``, by default the registry's clients)."""
        return self.reporter.summary(records)

    def restart_policy(self) -> None:
        """Start every GPU's policy from its initial state at the next tick (a new policy).

        The offline priority each GPU's old policy chose goes with it: the new one starts from
        the configured priority and chooses again (its initial state knows of no other).
        """
        self.policy_state.clear()
        self.s.offline_priority.clear()

    def apply(self, action: Action, now: float) -> None:
        """Carry out one controller action at monotonic ``now`` (outside a tick: tests, tools)."""
        self.actuator.apply(action, Tick(now, self.s.clock.time()))

    # ----------------------------------------------------------------------------- running

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
            if clock.sleep_until(self.duty.next_edge(deadline), self.stop_requested):
                return True
            if self.duty.pending():
                self.duty.edges_due(Tick.read(clock))
            if clock.monotonic() >= deadline:
                return False

    # ----------------------------------------------------------------------------- the tick

    def tick(self) -> None:
        """One control period: sense, decide per GPU, act, and report health to systemd."""
        s = self.s
        tick = Tick.read(s.clock)
        samples = list(s.gpu.sample())
        gpu_events = list(s.gpu.drain_events())
        p99 = s.latency.p99s(tick.monotonic_s)
        with s.lock:
            s.p99 = p99
            s.samples = samples
            for event in gpu_events:
                record_gpu_event(s, event)
            # A user's pause since the last tick froze a client in between: seen now.
            self.duty.note_paused(tick)
            records = s.registry.clients()
            # ops.sync only acts on clients appearing, ending or queueing (pauses reach ops
            # from the lifecycle): with every record the one synced last tick, it has nothing
            # to do.
            changed = self.views.refresh(records, tick)
            if changed:
                s.ops.sync(self._tracked(records, tick), tick.monotonic_s)
            observations: dict[str, Observation] = {}
            self.gates.update(records, tick, changed=changed)
            for sample in samples:
                if not s.shared(sample):
                    continue
                views = self.views.of_gpu(sample.uuid)
                observations[sample.uuid] = self._tick_gpu(sample, views, gpu_events, tick)
            # Queued jobs, or admitted foreground ones not yet taken by their submitter.
            if self.views.admitting:
                self._admit(observations, tick)
            elif s.waiting or s.reserved:
                s.waiting, s.reserved = {}, {}
            self.reporter.publish(observations, records, tick)
            self.duty.phase(tick)
            self.duty.note_paused(tick)
            self.duty.forget(self.views.live_ids)
            self.life.kill_overdue(tick.monotonic_s)
            self.ticks += 1
            # The STATUS= line counts this tick's clients (a change made by this tick's actions
            # shows at the next tick, 100 ms on): no second read of the registry every tick.
            line = self.reporter.summary_line(self.views.counts)
        self.reporter.report(tick, line)

    def _tick_gpu(
        self,
        sample: GpuSample,
        views: tuple[ClientView, ...],
        gpu_events: Sequence[GpuEvent],
        tick: Tick,
    ) -> Observation:
        """Sense one GPU, step its policy and carry out the actions."""
        s = self.s
        uuid, now = sample.uuid, tick.monotonic_s
        obs = observe_gpu(s, sample, views, gpu_events, tick, self.reporter)
        if self.life.startup.waiting:  # issue 32: a relaunch's first GPU work, timed
            startcost.measure(s, self.life.startup, sample, now)
        state = self.policy_state.get(uuid)
        if uuid not in self.policy_state:
            state = s.initial_policy_state(uuid, now)
        t0 = time.perf_counter()
        state, actions = s.policy.step(state, obs, now)
        s.ops.stepped(uuid, time.perf_counter() - t0)
        self.policy_state[uuid] = state
        for action in actions:
            try:
                self.actuator.apply(action, tick, uuid)
            except (RegistryError, *PAUSE_ERRORS) as exc:
                log.warning("action_failed", action=type(action).__name__, error=str(exc))
        if s.probe is not None:
            s.probe.set_offline_running(uuid, self.duty.offline_running(sample, views, tick))
        return obs

    def _tracked(self, records: Sequence[ClientRecord], tick: Tick) -> list[Tracked]:
        life = self.life
        return [
            Tracked(
                client_id=r.id,
                live=r.state.is_live and r.pid is not None,
                thawed=not life.is_paused(r.id),
                queued=r.state is S.QUEUED,
                # Never started: queued since submission; requeued: since the daemon saw it so.
                queued_since_wall_s=r.submitted_at if r.started_at is None else tick.wall_s,
            )
            for r in records
        ]

    def _admit(self, observations: Mapping[str, Observation], tick: Tick) -> None:
        """Start queued offline jobs where admission places them (SJF-BSBF, slots, D11).

        Why each other job waits is kept for ``status`` and ``list`` (``NodeState.waiting``).
        """
        s, now = self.s, tick.monotonic_s
        d = s.config.daemon
        records = s.registry.clients()
        for client_id in self.waiters.gone(records, now):
            # A foreground job whose submitter stopped asking (Ctrl-C, killed): it holds no place.
            self.waiters.forget(client_id)
            s.transition(client_id, S.EXITED, reason="its foreground submit stopped waiting")
        jobs = queued_jobs(records, now, tick.wall_s, self.life.retry_times())
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
            reserve=admission.GangReserve(d.gang_reserve_after_s, d.gang_reserve_max_s),
        )
        waiting = dict(planned.waiting)
        waiting.update(held_by_drain(jobs, waiting, s.samples, drained, open_gpus))
        for action in planned.admits:
            try:
                self.actuator.apply(action, tick)
            except (RegistryError, *PAUSE_ERRORS) as exc:
                log.warning("admit_failed", client_id=action.client_id, error=str(exc))
                # Still queued: the next round tries again; until then, this is why.
                waiting[action.client_id] = f"admitted, but the start failed: {exc}"
        s.waiting = waiting
        s.reserved = dict(planned.reserved)
