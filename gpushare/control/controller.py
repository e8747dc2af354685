"""gpushare's own sharing policy: SLO-driven duty cycle, offline share, memory and fault handling.

One :class:`GpushareController` serves every GPU; each GPU has its own frozen :class:`GpuState`
(defined, with the helpers several sections share, in :mod:`gpushare.control.gpu_state`, and
re-exported here). A step runs, in this order (``docs/controller.md`` gives the law and justifies
every constant); sections 1-4 and 6 are methods here, the others plain functions in their own
modules: the duty cycle (5) in :mod:`gpushare.control.duty`, the offline share (7) in
:mod:`gpushare.control.share`, the restarts that follow it in :mod:`gpushare.control.restarts`, and
the offline priority (8) in :mod:`gpushare.control.priority`:

1. **GPU lost** (``sample.lost``): alert once and do nothing else on that GPU (admission skips it).
2. **MPS fault** (``MpsState.FAULT`` or a fatal XID): :class:`RecoverMps` (the daemon removes offline
   clients first and requeues restartable ones) plus a critical :class:`Alert`, repeated with a
   doubling backoff while the fault persists; nothing else is decided until MPS is back up.
3. **Failing clients**: an offline client whose ``failures`` reached ``max_client_failures`` is
   stopped (:class:`Evict` with ``requeue=False``) with the reason recorded in an alert.
4. **Memory protection**: while free memory is under the online reserve, offline clients are
   evicted, restartable ones first and then largest first, until the memory they hold covers the
   deficit; a client already going away is not evicted twice.
5. **Duty-cycle throttle** (fast lever): AIMD on the worst normalised online signal with a
   comfort band, an immediate freeze at the hard threshold, slow increases near the duty that last
   broke the SLO. The probe yields to app latency (counts only at the hard threshold) while every
   online client reports it and the app SLOs have room. Online clients are never the target of any throttle action.
6. **Request gating** (:class:`SetGating`): on while a live online client sends request
   boundaries and requests are not in flight over ``max_busy`` of the gate's window (the gate
   itself, :mod:`gpushare.control.gate`, freezes offline work during requests in the daemon's fast
   path). With gating on and only shallow offline queues, the duty cycle follows app latency only
   and cuts only at the hard ratio, and the share goes to the GPU's offline ceiling; the gate's
   **delay** (how long a spell of requests runs beside offline work before the gate closes)
   doubles while app latency has room under the SLO and halves at a breach; where the mean
   gated app latency shows a loose SLO (steady, no breach remembered), it goes at once to the
   room the SLO leaves over that mean.
7. **Offline SM share** (slow lever): recomputed from online latency measured while offline work
   has been quiet for ``quiet_settle`` (the SMs its SLO leaves; the SMs online work leaves idle
   when online work alone breaks its SLO), split over the GPU's offline clients, with hysteresis
   and a minimum interval (a cut while the duty holds offline frozen waits for ``quiet_settle``
   of samples, or for the duty to let offline run); then restartable offline clients running
   under a different share are restarted one at a time, never during an SLO violation, and with
   gating on a deep ``--queue auto`` client is relaunched shallow first
   (:mod:`gpushare.control.restarts`).
8. **Offline priority** (:class:`SetOfflinePriority`, :mod:`gpushare.control.priority`): offline
   clients launched from now on get the online clients' MPS priority (0) once every online client
   has stayed well under its SLOs for ``share_min_interval``, and the configured one (1) again at
   the first violation; running clients keep theirs.

Pure: no I/O, no clock; ``now`` is an argument.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields, replace

from gpushare.config import ControlConfig
from gpushare.control import restart_cost
from gpushare.control.duty import duty_signals, throttle
from gpushare.control.gatedelay import gate_delay
from gpushare.control.gpu_state import (
    GpuState,
    client_share_pct,
    failure_backoff_s,
)
from gpushare.control.priority import offline_priority
from gpushare.control.restarts import restarts
from gpushare.control.share import offline_share
from gpushare.control.signals import Signals, free_memory_bytes, online_signals
from gpushare.model import (
    Action,
    Alert,
    Evict,
    MpsState,
    Observation,
    RecoverMps,
    SetGating,
    Severity,
)

# GpuState and the helpers live in gpu_state.py; callers keep importing them from here.
__all__ = ["GpuState", "GpushareController", "client_share_pct", "failure_backoff_s"]


class GpushareController:
    """gpushare's policy: see the module docstring. One instance serves every GPU."""

    name = "gpushare"
    gpu_mode = "mps"
    preemption = None

    def __init__(self, config: ControlConfig) -> None:
        self.config = config
        #: ``[control] offline_mps_priority``: what offline clients are launched with.
        self.offline_mps_priority = config.offline_mps_priority

    def initial_state(self, gpu_uuid: str, now: float) -> GpuState:
        """A GPU the controller has not seen: offline runs free, share at its default."""
        return GpuState(gpu_uuid=gpu_uuid, share_pct=self.config.offline_sm_pct_default)

    def step(
        self, state: GpuState, observation: Observation, now: float
    ) -> tuple[GpuState, Sequence[Action]]:
        """Decide this tick's actions for one GPU (see the module docstring for the order)."""
        idle = self._idle(state, observation)
        if idle is not None:
            return idle, []
        gpu = observation.gpu_uuid
        actions: list[Action] = []
        # A new state only where something changed: the step runs every tick for every GPU,
        # and a replace of this many fields costs more than the rest of an idle GPU's step.
        if state.evicting or state.stopped:
            present = {c.client_id for c in observation.clients}
            live = {c.client_id for c in observation.clients if c.state.is_live}
            evicting = tuple(e for e in state.evicting if e[0] in live)
            stopped = frozenset(c for c in state.stopped if c in present)
            if len(evicting) != len(state.evicting) or len(stopped) != len(state.stopped):
                state = replace(state, evicting=evicting, stopped=stopped)

        if observation.sample.lost:
            if not state.lost:
                why = observation.sample.error or "NVML reports the GPU lost"
                actions.append(
                    Alert(gpu, Severity.CRITICAL, f"GPU lost ({why}): admissions stopped here")
                )
            return replace(state, lost=True), actions
        if state.lost:
            actions.append(Alert(gpu, Severity.INFO, "GPU readable again: admissions resume"))
            state = replace(state, lost=False)

        state, recovering = self._faults(state, observation, now, actions)
        if recovering:
            return state, actions

        state = self._failing_clients(state, observation, now, actions)
        state = self._memory(state, observation, now, actions)
        signals = online_signals(observation, self.config.probe_slo_ratio)
        duty = duty_signals(self.config, state, observation, signals)
        state = throttle(self.config, state, observation, duty, actions)
        state = self._gating(state, observation, signals, now, actions)
        state = offline_share(self.config, state, observation, signals, now, actions)
        state = restarts(self.config, state, observation, signals, now, actions)
        state = offline_priority(self.config, state, signals, now, actions)
        return state, actions

    def _idle(self, state: GpuState, obs: Observation) -> GpuState | None:
        """The step of a GPU with no client and nothing to settle; ``None`` when it is not one.

        Such a GPU (most of a node's, often) makes every section above a no-op: no fault, loss or
        memory shortfall to act on, no online client (offline runs free: duty 1, counters reset,
        gating off as last sent), no share sample, no restart. What the sections would return is
        the state with one more quiet tick and no action; this returns that without running them,
        where the step runs for every GPU every tick. Each condition below is one a section
        checks; ``tests/control/test_controller_idle.py`` holds the answer to the full step's over
        random states and observations.
        """
        if (
            obs.clients
            or obs.gpu_events
            or obs.sample.lost
            or obs.mps_state is not MpsState.UP
            or state.lost
            or state.recovering_since_s is not None
            or state.evicting
            or state.stopped
            or state.restart_pending is not None
            or state.memory_alerted
            or state.demand_samples
            or state.quiet_signals
            or state.app_quiet_signals
            or state.quiet_sampled_since_s is not None
            or not state.share_emitted
            or state.duty != 1.0
            or state.duty_emitted != 1.0
            or state.comfortable_ticks
            or state.violation_ticks
            or state.breach_duty is not None
            or state.gated_shallow
            or state.gating_emitted is True
            or state.offline_priority is not None
            or state.priority_room_since_s is not None
            or (obs.gate is not None and state.gating_emitted is not False)
            # The restarts' section counts the duty since the share was set (issue 32).
            or not restart_cost.tally_is_current(
                state.duty_tally, state.share_changed_at_s, state.duty
            )
        ):
            return None
        reserve = obs.mem_reserve_bytes
        free = free_memory_bytes(obs)
        if reserve > 0 and free is not None and free < reserve:
            return None
        cfg = self.config
        top = min(cfg.offline_sm_pct_max, obs.offline_sm_pct_max)
        low = min(cfg.offline_sm_pct_min, top)
        target = max(low, float(math.floor(top)))  # offline_share with no online client
        if state.share_pct > top or abs(target - state.share_pct) > cfg.share_hysteresis_pct:
            return None
        return _one_more_quiet_tick(state)

    # Faults and recovery -----------------------------------------------------------------------

    def _faults(
        self, state: GpuState, obs: Observation, now: float, actions: list[Action]
    ) -> tuple[GpuState, bool]:
        gpu = obs.gpu_uuid
        fatal = [e for e in obs.gpu_events if e.fatal]
        for event in obs.gpu_events:
            if not event.fatal:
                actions.append(Alert(gpu, Severity.WARNING, f"XID {event.xid} (not fatal)"))
        new_fatal = [
            e for e in fatal if state.last_recover_s is None or e.at_s > state.last_recover_s
        ]
        if obs.mps_state is MpsState.FAULT or new_fatal:
            if new_fatal:
                xids = ", ".join(str(e.xid) for e in new_fatal)
                cause = f"fatal XID {xids}"
            else:
                cause = "MPS server in FAULT"
            episode_start = (
                state.recovering_since_s if state.recovering_since_s is not None else now
            )
            due = (
                new_fatal
                or state.last_recover_s is None
                or now - state.last_recover_s >= self._recover_backoff(state.recover_attempts)
            )
            if due:
                attempts = 0 if new_fatal else state.recover_attempts
                why = (
                    f"{cause}: recovering MPS (offline clients removed first, restartable "
                    f"ones requeued, online clients reconnect); attempt {attempts + 1}"
                )
                actions.append(RecoverMps(gpu, why))
                actions.append(Alert(gpu, Severity.CRITICAL, why))
                state = replace(
                    state,
                    recovering_since_s=episode_start,
                    last_recover_s=now,
                    recover_attempts=attempts + 1,
                )
            return state, True
        if state.recovering_since_s is not None:
            if obs.mps_state is not MpsState.UP:
                # The recovery is running (STARTING/DOWN): decide nothing until MPS answers.
                return state, True
            took = now - state.recovering_since_s
            actions.append(Alert(gpu, Severity.INFO, f"MPS recovered after {took:.1f}s"))
            state = replace(state, recovering_since_s=None, recover_attempts=0)
        return state, False

    def _recover_backoff(self, attempts: int) -> float:
        return failure_backoff_s(max(1, attempts), self.config)

    # Failing offline clients -------------------------------------------------------------------

    def _failing_clients(
        self, state: GpuState, obs: Observation, now: float, actions: list[Action]
    ) -> GpuState:
        limit = self.config.max_client_failures
        stopped = set(state.stopped)
        evicting = list(state.evicting)
        for client in obs.offline():
            if client.failures < limit or client.client_id in stopped:
                continue
            why = (
                f"offline client {client.client_id} failed {client.failures} times "
                f"(limit {limit}): stopped, not requeued"
            )
            actions.append(Evict(client.client_id, requeue=False, reason=why))
            actions.append(Alert(obs.gpu_uuid, Severity.WARNING, why))
            stopped.add(client.client_id)
            evicting.append((client.client_id, now))
        if len(evicting) == len(state.evicting):
            return state  # nobody newly stopped
        return replace(state, stopped=frozenset(stopped), evicting=tuple(evicting))

    # Memory protection -------------------------------------------------------------------------

    def _memory(
        self, state: GpuState, obs: Observation, now: float, actions: list[Action]
    ) -> GpuState:
        reserve = obs.mem_reserve_bytes
        free = free_memory_bytes(obs)
        if reserve <= 0 or free is None or free >= reserve:
            return replace(state, memory_alerted=False) if state.memory_alerted else state
        by_id = {c.client_id: c for c in obs.clients}
        going = {cid for cid, _ in state.evicting}
        pending = 0
        for cid, since in state.evicting:
            mem = by_id[cid].mem_used_bytes if cid in by_id else None
            if mem is None and now - since < self.config.evict_grace_s:
                # A client of unknown size is still going away: give it its grace before more.
                return state
            pending += mem or 0
        need = reserve - free - pending
        if need <= 0:
            return state
        candidates = sorted(
            (c for c in obs.offline() if c.client_id not in going),
            key=lambda c: (not c.restartable, -(c.mem_used_bytes or 0), c.client_id),
        )
        evicting = list(state.evicting)
        for client in candidates:
            if need <= 0:
                break
            size = client.mem_used_bytes
            why = (
                f"free memory {_gib(free)} under the online reserve {_gib(reserve)}: "
                f"evicting offline client {client.client_id} holding "
                f"{_gib(size) if size is not None else 'unknown memory'}"
                + (", requeued" if client.restartable else "")
            )
            actions.append(Evict(client.client_id, requeue=client.restartable, reason=why))
            evicting.append((client.client_id, now))
            if size is None:
                break  # unknown size: see what it frees before evicting more
            need -= size
        state = replace(state, evicting=tuple(evicting))
        if need > 0 and not candidates and not state.memory_alerted:
            actions.append(
                Alert(
                    obs.gpu_uuid,
                    Severity.WARNING,
                    f"free memory {_gib(free)} under the online reserve {_gib(reserve)} and no "
                    "offline client left to evict: online clients hold it",
                )
            )
            state = replace(state, memory_alerted=True)
        return state

    # Request gating ---------------------------------------------------------------------------

    def _gating(
        self,
        state: GpuState,
        obs: Observation,
        signals: Signals,
        now: float,
        actions: list[Action],
    ) -> GpuState:
        """Gating on while online clients say when requests start and are not busy all the time.

        Off when no live online client sends request boundaries (nothing to gate on), and when
        requests were in flight more than ``max_busy`` of the gate's window: offline work would
        get under ``1 - max_busy`` of the time, which the duty cycle can beat at any SLO with
        room, and a client that claims a request in flight forever (lying, or one long request
        after another) would freeze offline work for good. Back on once the busy share falls 0.1
        under ``max_busy`` (hysteresis: no flapping at the threshold). The gate's delay is sent
        with it (:func:`gpushare.control.gatedelay.gate_delay`).
        """
        g = obs.gate
        if g is None:
            return state  # a runner without request gating
        busy = g.busy_fraction
        if not obs.online() or g.signalled_clients == 0:
            on, why = False, "no online client sends request boundaries"
        elif busy is not None and busy > g.max_busy:
            on = False
            why = (
                f"requests in flight {busy:.0%} of the time (over {g.max_busy:.0%}): gating "
                "would leave offline work almost nothing; the duty cycle decides"
            )
        elif busy is not None and state.gating_emitted is False and busy > g.max_busy - 0.1:
            on, why = False, f"requests in flight {busy:.0%} of the time: still too busy to gate"
        else:
            on = True
            share = "" if busy is None else f", requests in flight {busy:.0%} of the time"
            why = f"{g.signalled_clients} online client(s) send request boundaries{share}"
        state, delay_why = gate_delay(self.config, state, obs, signals, on, now)
        delay = state.gate_delay_s if on else 0.0
        if on != state.gating_emitted or delay != state.gate_delay_emitted_s:
            if on and on == state.gating_emitted:
                why = f"gate delay {state.gate_delay_emitted_s * 1e3:g} ms -> {delay * 1e3:g} ms"
            text = f"gating {'on' if on else 'off'}: {why}"
            if on and delay_why:
                text += f" ({delay_why})"
            actions.append(SetGating(obs.gpu_uuid, on, text, delay_s=delay))
            changed = now if on != state.gating_emitted else state.gating_changed_at_s
            state = replace(
                state, gating_emitted=on, gating_changed_at_s=changed, gate_delay_emitted_s=delay
            )
        return state


_STATE_FIELDS = tuple(f.name for f in fields(GpuState))


def _one_more_quiet_tick(state: GpuState) -> GpuState:
    """``replace(state, quiet_ticks=state.quiet_ticks + 1)``, in half its time.

    ``replace`` looks the fields up and checks them on every call; the idle fast path makes one
    such copy per empty GPU per tick (GpuState has no ``__post_init__`` to bypass).
    """
    new = object.__new__(GpuState)
    for name in _STATE_FIELDS:
        object.__setattr__(new, name, getattr(state, name))
    object.__setattr__(new, "quiet_ticks", state.quiet_ticks + 1)
    return new


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}GiB"
