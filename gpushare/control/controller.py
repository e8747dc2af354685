"""gpushare's own sharing policy: SLO-driven duty cycle, offline share, memory and fault handling.

One :class:`GpushareController` serves every GPU; each GPU has its own frozen :class:`GpuState`
(defined, with the helpers several sections share, in :mod:`gpushare.control.gpu_state`, and
re-exported here). A step runs, in this order (``docs/controller.md`` gives the law and justifies
every constant); sections 1-4 and 6 are methods here, the others plain functions in their own
modules: the duty cycle (5) in :mod:`gpushare.control.duty`, the offline share (7) in
:mod:`gpushare.control.share` and the restarts that follow it in :mod:`gpushare.control.restarts`:

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

Pure: no I/O, no clock; ``now`` is an argument.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields, replace

from gpushare.config import ControlConfig
from gpushare.control.duty import duty_signals, throttle
from gpushare.control.gpu_state import (
    GpuState,
    client_share_pct,
    failure_backoff_s,
    gated_shallow,
)
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

# The gate delay doubles on a raise and halves on a breach (docs/controller.md, "Gate delay"):
# the useful delay spans two decades (2 ms to 300 ms), which steps of a fixed size would cross
# either too slowly at the bottom or too coarsely at the top.
_DELAY_GROWTH = 2.0
_DELAY_CUT = 0.5
# After a cut the delay is not cut again for this long: the app latency window ([latency] window,
# 2 s by default) keeps the breach in its p99 for up to one window after the cut, and each cut of
# a breach already answered would halve the delay again for nothing (four halvings in a row on
# Transformer-XL next to ResNet-50 training at 1.5x with a 0.5 s cooldown).
_DELAY_CUT_COOLDOWN_S = 2.0
# A raise needs app latency over _DELAY_EVIDENCE_S, and the delay stays within the room the SLO
# leaves over the worst window of the last _DELAY_TAIL_S (violation_ratio minus that worst, times
# the SLO, in seconds). A delay adds at most itself to any request (online work stalled outright
# for all of it, the worst case), so the bound needs no measured slowdown. One 2 s latency window
# says little of a service's tail: on the 39 scenarios at 1.1x, where online work alone sits at
# 0.9 of its SLO, single windows read under comfort_ratio on up to a third of the ticks, and raises
# on them took the bursty Azure trace from 99.5 to 97.6 % attainment (a delay raised in a calm
# spell meets the next burst). Twice or three times the room (betting on online work keeping half
# its speed beside offline work) took it to 98.7 and 98.2 % for +0.008 and +0.013 offline on the
# Tally-shaped pairs at 1.5x. Until the memory spans _DELAY_TAIL_S the worst counts as at least
# comfort_ratio (the room at most a fifth of the SLO): the demo scenario's load step at 27 s met a
# 26 ms delay raised in its calm start (p99 +20 %, 99.65 % at 1.1x); with this, +9 % and 99.84 %.
_DELAY_EVIDENCE_S = 5.0
_DELAY_TAIL_S = 30.0
# The tail's long memory: the worst app reading of each _DELAY_BUCKET_S over _DELAY_MEMORY_S, kept
# while gating goes off and on (the 30 s memory above restarts then, and what it saw before a busy
# spell turned gating off was forgotten with it). Read only where the delay applies (gated,
# shallow queues): beside the duty cycle the reading says more of the duty than of the service's
# tail. A breach a delay caused stays in it too: the delay stays small for minutes after one.
# Ten minutes: load on the Azure LLM
# traces changes on the scale of minutes; 10 s buckets keep it to 60 entries. Latency seen in a
# calm spell cannot tell a calm spell from a loose SLO, so the room also grows with how long the
# tail is known: times min(1, span of the long memory / gate_delay_trust). On the 39 scenarios at
# 1.1x, the bursty Azure trace's steady load at 20 s and the demo's load step at 27 s met delays
# raised in their calm starts; see docs/controller.md "Gate delay" for the measured trade-off.
_DELAY_BUCKET_S = 10.0
_DELAY_MEMORY_S = 600.0
# A delay is held this long without app latency from every online client, then dropped: BERT
# inference at load 0.5 (10 requests/s) fills the latency window's 20 samples only every few
# seconds on the Tally-shaped pairs (gaps of up to 5 s seen in a 20 s run); a service that stops
# reporting keeps a delay no longer than this.
_DELAY_BLIND_S = 10.0
# A loose SLO, measured (docs/controller.md, "A loose SLO"). The room above assumes online work
# stalled for all of the delay and the worst window of the tail; at 1.5x on the Tally-shaped pairs
# it gives 0.001 of offline throughput in 20 s runs (0.458 against 0.457 with no delay), where a
# fixed 300 ms delay from the start gives 0.13 more (0.591) at 99.9 % attainment. One 2 s
# window's p99 says little there (0.39 to 0.96 of a 1.5x
# SLO on one pair); the mean of the tail's memory separates the factors (0.61-0.69 at 1.5x,
# 0.77-0.86 at 1.1x, lowest over a run). So where that mean, over at least _LOOSE_EVIDENCE_S,
# lies in [_LOOSE_LOADED, gate_delay_loose_below), does not rise by more than _LOOSE_RISE from the
# memory's older half to its newer half, and no gated reading of the long memory broke the SLO,
# the room is what the SLO leaves over that mean, with no trust ramp, and a raise goes there at
# once. Under _LOOSE_LOADED, readings say a light load as much as a loose SLO (the bursty Azure
# trace's calm start reads 0.04-0.1 of its SLO and a burst reaches it 5 s later: -2.1 points at
# 1.05x without this bound, none with it); the room rule above still serves such a service (and
# a steady one at 3x its p99 or looser: 0.2 instead cost the demo 0.24 points at every factor). The
# rise check caught the same trace's climb (means 0.1 -> 0.44 within 10 s) where the band alone
# did not: -0.15 offline there at 1.05x without it.
_LOOSE_EVIDENCE_S = 5.0
_LOOSE_LOADED = 0.4
_LOOSE_RISE = 0.1
# Beside offline work at MPS priority 1 online work runs at most this many times slower (the
# mps-priority baseline, offline unthrottled at that priority: worst p99 +52 % on the pairs, +57 %
# on all 39 scenarios), so a request beside the first D of a spell loses at most D x (1 - 1/2):
# the loose room is the SLO's room over the mean times 1 / (1 - 1/2). Measured: 0.518 -> 0.534 at
# 1.5x on the pairs (x3: 0.540), no scenario's attainment moving at any factor.
_LOOSE_SLOWDOWN = 2.0
# Delays are rounded to a microsecond: repeated doubling and halving must not drift.
_DELAY_DIGITS = 6


class GpushareController:
    """gpushare's policy: see the module docstring. One instance serves every GPU."""

    name = "gpushare"
    offline_mps_priority = 1

    def __init__(self, config: ControlConfig) -> None:
        self.config = config

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
            or (obs.gate is not None and state.gating_emitted is not False)
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
        with it (:meth:`_gate_delay`).
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
        state, delay_why = self._gate_delay(state, obs, signals, on, now)
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

    def _gate_delay(
        self, state: GpuState, obs: Observation, signals: Signals, on: bool, now: float
    ) -> tuple[GpuState, str]:
        """The gate's delay this tick (in the returned state), and why it moved ("" if not).

        The room a looser SLO leaves, given to offline work (docs/controller.md, "Gate delay").
        While gating is on with shallow queues and every online client reports app latency, the
        delay grows from ``gate_delay_min`` (doubling) after ``gate_delay_raise_after_ticks``
        ticks with the worst app p99 under ``comfort_ratio`` of its SLO, up to
        ``gate_delay_max`` and the room the SLO leaves over the recent tail; it halves (0 under
        ``gate_delay_min``) over ``violation_ratio``, at most once per ``_DELAY_CUT_COOLDOWN_S``
        (the window still holds the breach for a while after a cut), and drops to 0 at
        ``cut_ratio``. Raises past half the delay that last breached wait
        ``slow_increase_after_ticks``. Anywhere else it is 0: the gate closes at the first
        request.
        """
        cfg = self.config
        delay, comfortable = state.gate_delay_s, state.gate_delay_comfortable
        breach, cut_at = state.gate_delay_breach_s, state.gate_delay_cut_at_s
        seen = state.gate_delay_seen_s
        recent = state.gate_delay_recent
        app = signals.app_worst
        history = state.gate_delay_history
        if on and app is not None and signals.app_complete and gated_shallow(state, obs):
            history = _remember(history, now, app, _DELAY_BUCKET_S, _DELAY_MEMORY_S)
        why = ""
        if not on or cfg.gate_delay_max_s <= 0 or not gated_shallow(state, obs):
            # With a deep queue a freeze lags by an iteration anyway: no delay on top of it.
            delay, comfortable, breach, cut_at, recent = 0.0, 0, None, None, ()
        elif not signals.app_complete or app is None:
            # No app latency from every online client this tick: the window is thin (a service
            # at 10 requests/s fills 20 samples in 2 s only now and then) or a client does not
            # report. The delay is held, not raised, for a while; then it goes: without app
            # latency there is no measure of what it costs requests (the probe is no request).
            if delay > 0 and (seen is None or now - seen > _DELAY_BLIND_S):
                delay, comfortable = 0.0, 0
                why = f"no app latency from every online client for {_DELAY_BLIND_S:g} s: delay 0"
        else:
            seen = now
            # The tail's memory: the worst reading of each second, the last _DELAY_TAIL_S of them.
            recent = _remember(recent, float(math.floor(now)), app, 1.0, _DELAY_TAIL_S)
            cooling = cut_at is not None and now - cut_at < _DELAY_CUT_COOLDOWN_S - 1e-9
            if app >= cfg.cut_ratio:
                # A clear breach: a delay costs requests at once and is cheap to rebuild (2 ms to
                # 256 ms in 3.5 s), so no halvings while the window still holds the breach.
                if delay > 0:
                    breach, cut_at = delay, now
                    why = f"app p99 at {app:.2f}x its SLO >= cut ratio {cfg.cut_ratio:g}: delay 0"
                delay, comfortable = 0.0, 0
            elif app > cfg.violation_ratio:
                comfortable = 0
                if delay > 0 and not cooling:
                    breach, cut_at = delay, now
                    half = delay * _DELAY_CUT
                    delay = 0.0 if half < cfg.gate_delay_min_s else round(half, _DELAY_DIGITS)
                    why = f"app p99 at {app:.2f}x its SLO: delay halved"
            elif app >= cfg.comfort_ratio:
                comfortable = 0  # inside the comfort band: held
            elif delay < cfg.gate_delay_max_s:
                comfortable += 1
                raised = cfg.gate_delay_min_s if delay <= 0 else delay * _DELAY_GROWTH
                raised = round(min(cfg.gate_delay_max_s, raised), _DELAY_DIGITS)
                # The room: a delay adds at most itself to a request's latency (online work
                # stalled outright for all of it, the worst case), so it stays within what the
                # SLO leaves over the worst window of the tail's memory, in seconds.
                tail = max(v for _, v in recent)
                if now - recent[0][0] < _DELAY_TAIL_S:
                    # A memory not yet full says little of the tail (a calm start before a load
                    # step): it counts as at least the comfort band's edge until then.
                    tail = max(tail, cfg.comfort_ratio)
                # The long memory: a burst seen once keeps the room small for minutes, and a tail
                # known only briefly leaves only part of its room.
                tail = max(tail, max(v for _, v in history))
                known_s = now - history[0][0]
                trust = (
                    min(1.0, known_s / cfg.gate_delay_trust_s) if cfg.gate_delay_trust_s else 1.0
                )
                slo_ms = min((c.slo_p99_ms for c in obs.online() if c.slo_p99_ms), default=0.0)
                room_s = (cfg.violation_ratio - tail) * slo_ms / 1e3 * trust
                loose = _loose_mean(cfg, recent, history, now)
                if loose is not None:
                    # A loose SLO, measured (_LOOSE_* above): the room over the tail's mean,
                    # trusted at once, and one raise goes all the way there.
                    room_s = (
                        (cfg.violation_ratio - loose) * slo_ms / 1e3 / (1 - 1 / _LOOSE_SLOWDOWN)
                    )
                    raised = round(min(cfg.gate_delay_max_s, max(raised, room_s)), _DELAY_DIGITS)
                wait = cfg.gate_delay_raise_after_ticks
                if breach is not None and raised > breach * _DELAY_CUT:
                    # Above where the last cut landed, each raise probes toward the delay that
                    # broke the SLO: probe slowly, as the duty cycle does.
                    wait = max(wait, cfg.slow_increase_after_ticks)
                evidence = now - recent[0][0] >= _DELAY_EVIDENCE_S
                if comfortable >= wait and evidence and room_s >= cfg.gate_delay_min_s:
                    raised = round(min(raised, room_s), _DELAY_DIGITS)
                    if raised > delay:
                        seen_as = (
                            f"at most {tail:.2f}x"
                            if loose is None
                            else f"a loose SLO: {loose:.2f}x on average"
                        )
                        why = (
                            f"app p99 at {app:.2f}x its SLO, under comfort ratio "
                            f"{cfg.comfort_ratio:g} for {comfortable} ticks, {seen_as} over "
                            f"{now - recent[0][0]:.0f} s: delay raised "
                            f"(the SLO leaves {room_s * 1e3:.1f} ms)"
                        )
                        delay, comfortable = raised, 0
                        if breach is not None and delay > breach:
                            breach = None  # past the delay that broke the SLO, unharmed
        new = (delay, comfortable, breach, cut_at, seen, recent, history)
        old = (
            state.gate_delay_s,
            state.gate_delay_comfortable,
            state.gate_delay_breach_s,
            state.gate_delay_cut_at_s,
            state.gate_delay_seen_s,
            state.gate_delay_recent,
            state.gate_delay_history,
        )
        if new != old:
            state = replace(
                state,
                gate_delay_s=delay,
                gate_delay_comfortable=comfortable,
                gate_delay_breach_s=breach,
                gate_delay_cut_at_s=cut_at,
                gate_delay_seen_s=seen,
                gate_delay_recent=recent,
                gate_delay_history=history,
            )
        return state, why


_STATE_FIELDS = tuple(f.name for f in fields(GpuState))


def _loose_mean(
    cfg: ControlConfig,
    recent: tuple[tuple[float, float], ...],
    history: tuple[tuple[float, float], ...],
    now: float,
) -> float | None:
    """The mean of the tail's memory when it shows a loose SLO (``_LOOSE_*``), else ``None``.

    Loose: the memory spans ``_LOOSE_EVIDENCE_S``; its mean lies in ``[_LOOSE_LOADED,
    gate_delay_loose_below)``; the mean of its newer half is at most ``_LOOSE_RISE`` over its
    older half's (a load on the rise is no steady one); no reading of the long memory broke the
    SLO (a breach, a delay's own included, leaves the room rule in charge for
    ``_DELAY_MEMORY_S``). ``gate_delay_loose_below = 0`` turns this off.
    """
    if cfg.gate_delay_loose_below <= 0 or not recent or now - recent[0][0] < _LOOSE_EVIDENCE_S:
        return None
    if history and max(v for _, v in history) > cfg.violation_ratio:
        return None
    mean = sum(v for _, v in recent) / len(recent)
    if not _LOOSE_LOADED <= mean < cfg.gate_delay_loose_below:
        return None
    mid = (recent[0][0] + now) / 2
    older = [v for t, v in recent if t < mid]
    newer = [v for t, v in recent if t >= mid]
    if older and newer and sum(newer) / len(newer) > sum(older) / len(older) + _LOOSE_RISE:
        return None
    return mean


def _remember(
    memory: tuple[tuple[float, float], ...], at: float, app: float, bucket_s: float, span_s: float
) -> tuple[tuple[float, float], ...]:
    """``memory`` with ``app`` (a worst app signal stamped ``at``) in its bucket.

    An entry is ``(first stamp in its bucket, worst reading)`` of one ``bucket_s``; entries
    stamped more than ``span_s`` before ``at`` are dropped. The gate delay keeps two: the tail's
    30 s memory (1 s buckets, stamped with the second) and its long memory (10 s buckets).
    """
    if memory and math.floor(memory[-1][0] / bucket_s) == math.floor(at / bucket_s):
        return (*memory[:-1], (memory[-1][0], max(memory[-1][1], app)))
    return (*(m for m in memory if m[0] >= at - span_s), (at, app))


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
