"""The offline duty cycle between ticks, and whether offline work may run (the probe's "quiet").

:class:`DutyCycle` carries out each GPU's offline duty (see :mod:`gpushare.model`): at the start
of a period (:meth:`DutyCycle.phase`, once a tick) every offline client of a throttled GPU is
thawed and its GPU's duty edge set at ``duty x period``; at the edge (:meth:`DutyCycle.edges_due`,
from the loop's wait) they are frozen again. Freezing goes through the
:class:`~gpushare.daemon.lifecycle.Lifecycle` (and its arbiter); the client's state in the
registry (RUNNING, THROTTLED, FROZEN) follows. It also owns the
:class:`~gpushare.daemon.drain.DrainTracker` that says when a frozen client has stopped using the
GPU, and so whether offline work may run until the next tick (:meth:`DutyCycle.offline_running`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpushare.daemon.drain import DrainTracker
from gpushare.daemon.freeze import DAEMON_REASONS, DUTY, HOLD
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.registry import ClientRecord
from gpushare.daemon.state import PAUSE_ERRORS, RUNNING_STATES, NodeState
from gpushare.daemon.tick import Tick
from gpushare.model import ClientClass, ClientState, ClientView, GpuSample

S = ClientState
# The daemon's freeze reasons the duty cycle gives a client.
_NONE: frozenset[str] = frozenset()
_HOLD = frozenset({HOLD})
_DUTY = frozenset({DUTY})


@dataclass(frozen=True, slots=True)
class _Inputs:
    """What a period's decisions depend on, besides the time (which only places the edges)."""

    records: Sequence[ClientRecord]
    duties: dict[str, float]
    going: tuple[str, ...]
    have: dict[str, frozenset[str]]
    period_s: float

    def same(self, other: _Inputs) -> bool:
        """The same inputs: the same record objects (a changed client is a new record)."""
        return (
            len(self.records) == len(other.records)
            and all(map(operator.is_, self.records, other.records))
            and self.duties == other.duties
            and self.going == other.going
            and self.have == other.have
            and self.period_s == other.period_s
        )


class DutyCycle:
    """Duty edges per GPU and the drain after a freeze; see the module docstring."""

    def __init__(self, state: NodeState, lifecycle: Lifecycle) -> None:
        self.s = state
        self.life = lifecycle
        #: Per GPU, the monotonic time of the coming duty edge (the freeze within the period).
        self._edges: dict[str, float] = {}
        #: When frozen offline clients have drained their queued kernels (probe "quiet").
        self.drain = DrainTracker()
        # Per GPU, its views as last given (the same tuple until a record changes) and their
        # live offline ones: not picked out of every client again at every tick.
        self._offline: dict[str, tuple[Sequence[ClientView], list[ClientView]]] = {}
        # The inputs of the last period that froze, thawed and moved no client, and its edges.
        self._quiet: tuple[_Inputs, list[tuple[str, float]]] | None = None

    def next_edge(self, deadline: float) -> float:
        """The earlier of ``deadline`` and the coming duty edge of any GPU."""
        return min([deadline, *self._edges.values()])

    def pending(self) -> bool:
        """Whether any GPU has a duty edge still to come this period."""
        return bool(self._edges)

    def phase(self, tick: Tick) -> None:
        """Start of a period: thaw or freeze offline clients as each GPU's duty says."""
        period = self.s.config.control.period_s
        self._edges.clear()
        # Read once this tick already with the look for other connections' commits (tick()).
        records = self.s.registry.clients(check=False)
        # The daemon's reasons of every client, in one look at the arbiter: a client that already
        # has the reasons it should have is left alone (freeze_for would change and request
        # nothing), instead of one locked call for each of hundreds of idle clients every tick.
        # The arbiter's state, not a copy of the last decision, is compared: a request that
        # failed is asked again at the next tick, as before.
        have = self.s.freeze.reasons_among(DAEMON_REASONS)
        inputs = _Inputs(records, dict(self.s.duty), self.life.going(), have, period)
        if self._quiet is not None and self._quiet[0].same(inputs):
            # The same records, duties, clients told to go and reasons as a period that changed
            # nothing: this one changes nothing either. Only its duty edges are set again.
            plan = self._quiet[1]
        else:
            changed, plan = self._decide(inputs)
            self._quiet = None if changed else (inputs, plan)
        for gpu, duty in plan:
            self._edges[gpu] = tick.monotonic_s + duty * period

    def _decide(self, inputs: _Inputs) -> tuple[bool, list[tuple[str, float]]]:
        """Freeze, thaw and move each client as its duty says.

        Returns whether any call was made, and the GPUs whose duty edge comes this period with
        their duty (in the order met: the edges are set in that order).
        """
        life, duties, have = self.life, inputs.duties, inputs.have
        changed = False
        plan: list[tuple[str, float]] = []
        for rec in inputs.records:
            if rec.state not in RUNNING_STATES or rec.pid is None:
                continue
            if life.exiting(rec.id):
                # Cancelled or evicted: it was thawed to act on its signal; freezing it again
                # would turn a clean exit into the SIGKILL at the end of the grace.
                if have.get(rec.id, _NONE) != _NONE:
                    life.freeze_for(rec.id)
                    changed = True
                continue
            if rec.gang:
                # A gang (one cgroup) runs at the smallest duty of its GPUs: a freeze on any GPU
                # freezes every rank, and it waits at the next collective for the slowest anyway.
                duty, edge_gpu = min((duties.get(u, 1.0), u) for u in rec.gang)
            else:
                edge_gpu = rec.gpu_uuid or ""
                duty = 1.0 if rec.gpu_uuid is None else duties.get(rec.gpu_uuid, 1.0)
            if rec.held:
                want, reasons = S.FROZEN, _HOLD
            elif rec.cls is ClientClass.ONLINE or duty >= 1.0:
                want, reasons = S.RUNNING, _NONE
            else:
                want, reasons = S.THROTTLED, _DUTY if duty <= 0.0 else _NONE
                if duty > 0.0:
                    plan.append((edge_gpu, duty))
            if have.get(rec.id, _NONE) != reasons:
                life.freeze_for(rec.id, *reasons)
                changed = True
            if rec.state is not want:
                why = f"offline duty {duty:g} on its GPU" if want is S.THROTTLED else None
                self.s.transition(rec.id, want, reason=rec.reason if want is S.FROZEN else why)
                changed = True
        return changed, plan

    def edges_due(self, tick: Tick) -> None:
        """Freeze the throttled offline clients of the GPUs whose duty edge has come."""
        with self.s.lock:
            due = {gpu for gpu, at in self._edges.items() if at <= tick.monotonic_s}
            if not due:
                return
            for gpu in due:
                del self._edges[gpu]
            ids = [
                rec.id
                for rec in self.s.registry.clients()
                if not due.isdisjoint(rec.gpus())
                and rec.cls is ClientClass.OFFLINE
                and rec.state is S.THROTTLED
                and not self.life.exiting(rec.id)
                and not self.life.is_paused(rec.id)
            ]
            if not ids:
                return
            self.life.freeze_all(ids)
            self.note_paused(tick)

    # ----------------------------------------------------------------------------- the drain

    def note_paused(self, tick: Tick) -> None:
        """Tell the drain tracker which clients the daemon holds frozen now."""
        self.drain.note_paused(self.life.paused, tick.monotonic_s, tick.wall_s)

    def forget(self, live: Iterable[str]) -> None:
        """Drop the drain state of every client not in ``live``."""
        self.drain.forget(live)

    def _offline_of(self, gpu_uuid: str, views: Sequence[ClientView]) -> list[ClientView]:
        """The live offline clients among ``views`` (kept while ``views`` is the same object)."""
        kept = self._offline.get(gpu_uuid)
        if kept is not None and kept[0] is views:
            return kept[1]
        offline = [v for v in views if v.cls is ClientClass.OFFLINE and v.state.is_live]
        self._offline[gpu_uuid] = (views, offline)
        return offline

    def offline_running(self, sample: GpuSample, views: Sequence[ClientView], tick: Tick) -> bool:
        """Whether offline work may run on the GPU until the next tick (the probe's "not quiet").

        A client frozen at the last duty edge runs again in this period unless the duty is 0 or it
        is held: "frozen right now" is not "quiet". A client frozen for good is quiet only once
        its queued kernels have drained (:mod:`gpushare.daemon.drain`).
        """
        offline = self._offline_of(sample.uuid, views)
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
        life = self.life
        for v in offline:
            if not life.is_paused(v.client_id) or (duty > 0.0 and not v.held):
                return True
            # Issue 32: kernels queued deep before a live switch drain as a deep queue's.
            now = tick.monotonic_s
            shallow = v.shallow and life.live.settled(v.client_id, now, self.drain.deep_s)
            if not self.drain.drained(v.client_id, uuid, now, shallow=shallow):
                return True
        return False
