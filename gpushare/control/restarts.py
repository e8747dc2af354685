"""Restarts under a new share: when gpushare's controller relaunches a restartable offline client.

The last section of :meth:`~gpushare.control.controller.GpushareController.step`, after the share
is set (``docs/controller.md``, "Offline SM share"). A restartable offline client running under
another SM percentage than its share of the GPU's offline share is checkpointed and relaunched
(:class:`RestartClient`), one client at a time and never during an SLO violation; a ``--queue
auto`` client is relaunched with a shallow queue once request gating is on (:func:`shallow_restart`)
and with a deep one once gating has been off a while (:func:`queue_restart`). Plain functions of
the control config and the GPU's state; pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import replace

from gpushare.config import ControlConfig
from gpushare.control import restart_cost
from gpushare.control.gpu_state import (
    RESTARTABLE_STATES,
    GpuState,
    above_share,
    app_only,
    client_share_pct,
    gated_shallow,
    leaving,
)
from gpushare.control.share import quiet_level
from gpushare.control.signals import Signals
from gpushare.model import (
    Action,
    ClientState,
    ClientView,
    MpsState,
    Observation,
    RestartClient,
    queue_mode,
)

# A restart request still unfinished after this long is given up and may be retried: a
# checkpoint of a large training job can take minutes, so never less than this.
_MIN_RESTART_PATIENCE_S = 300.0
# Request gating on for this long (and a busy share measured) before a deep --queue auto client
# is relaunched shallow: a second of history is what the gate needs to say whether requests keep
# it busier than max_busy (which turns gating off again); past that, every tick with the deep
# queue is a tick gating cannot protect requests.
_SHALLOW_RESTART_AFTER_S = 1.0


def restarts(
    config: ControlConfig,
    state: GpuState,
    obs: Observation,
    signals: Signals,
    now: float,
    actions: list[Action],
) -> GpuState:
    """Ask for at most one restart this tick, or wait for the one in flight; the new state.

    The duty the restart verdicts read is its mean since the share was set
    (:class:`~gpushare.control.restart_cost.DutyTally`, counted here each tick). A pending
    restart holds every other until the client has relaunched, gone, or no longer needs
    it, or until ``max(share_min_interval, 300 s)`` has passed. None is asked during an SLO
    violation (the app latency alone while gated with shallow queues), with MPS not up, or while
    an offline client is restarting. Then, in order: a deep ``--queue auto`` client relaunched
    shallow while gating is on (:func:`shallow_restart`); the restartable client whose SM cap is
    furthest from its share (those above it first, :func:`needs_restart`; a cut is never paid
    for while online work measured alone holds the duty down, ``restart_cost.verdict``); a
    shallow ``--queue auto`` client relaunched deep while gating is off (:func:`queue_restart`).
    """
    tally = restart_cost.tally_duty(state.duty_tally, state.share_changed_at_s, state.duty, now)
    if tally is not state.duty_tally:
        state = replace(state, duty_tally=tally)
    if state.restart_pending is not None:
        if _still_pending(config, state, obs, now):
            return state
        state = replace(state, restart_pending=None)
    worst = app_only(signals).worst if gated_shallow(state, obs) else signals.worst
    violating = worst is not None and worst > config.violation_ratio
    if violating or obs.mps_state is not MpsState.UP:
        return state
    if any(c.state is ClientState.RESTARTING for c in obs.offline()):
        return state
    going = leaving(state)
    if state.gating_emitted is True:
        state, asked = shallow_restart(config, state, obs, going, now, actions)
        if asked:
            return state
    off_share = [
        c
        for c in obs.offline()
        if c.restartable
        and c.state in RESTARTABLE_STATES
        and c.client_id not in going
        and needs_restart(config, c, state.share_pct)
    ]
    if not off_share:
        return queue_restart(config, state, obs, going, now, actions)
    # Issue 32: only when the gain over the expected hold pays the restart's cost.
    verdicts = _verdicts(config, state, off_share, tally.mean(now), now)
    candidates = [c for c in off_share if verdicts[c.client_id].worth]
    if not candidates:
        return queue_restart(config, state, obs, going, now, actions)
    # Clients above the share first (they crowd online work), then the largest gap.
    chosen = max(
        candidates,
        key=lambda c: (
            c.limits.sm_pct > client_share_pct(state.share_pct, c),
            abs(c.limits.sm_pct - client_share_pct(state.share_pct, c)),
            c.client_id,
        ),
    )
    target = client_share_pct(state.share_pct, chosen)
    pays = verdicts[chosen.client_id].reason
    actions.append(
        RestartClient(
            chosen.client_id,
            target,
            f"restartable offline client runs at {chosen.limits.sm_pct:g}%, offline share is "
            f"{target:g}%: checkpoint and relaunch ({pays})",
        )
    )
    return replace(state, restart_pending=(chosen.client_id, now))


def _verdicts(
    config: ControlConfig,
    state: GpuState,
    clients: list[ClientView],
    mean_duty: float,
    now: float,
) -> dict[str, restart_cost.RestartVerdict]:
    """Whether restarting each of ``clients`` under its share pays now, by client id.

    Online work measured alone (the share's evidence, :func:`quiet_level`) at or over the comfort
    ratio means the duty cycle does not climb, so a cut frees nothing (issue 32). Read only when
    some client is off its share: the window's maximum is not idle-tick work.
    """
    quiet = quiet_level(state)
    duty_held = quiet is not None and quiet >= config.comfort_ratio
    return {
        c.client_id: restart_cost.verdict(
            config, c, client_share_pct(state.share_pct, c), mean_duty,
            state.share_changed_at_s, now, duty_held_by_online=duty_held,
        )
        for c in clients
    }  # fmt: skip


def _still_pending(config: ControlConfig, state: GpuState, obs: Observation, now: float) -> bool:
    """Whether the restart asked for is still to come (and not waited for too long)."""
    assert state.restart_pending is not None
    pending = state.restart_pending
    client = next((c for c in obs.clients if c.client_id == pending[0]), None)
    patience = max(config.share_min_interval_s, _MIN_RESTART_PATIENCE_S)
    settled = client is not None and client.state is not ClientState.RESTARTING
    done = (
        client is None
        or not client.state.is_live
        # Relaunched since the request (the runner's start time, on this clock): whatever
        # the share or gating did meanwhile, the restart asked for has happened.
        or (settled and client.started_at_s is not None and client.started_at_s >= pending[1])
        or (settled and now > pending[1] and not needs_restart(config, client, state.share_pct))
    )
    return not (done or now - pending[1] > patience)


def shallow_restart(
    config: ControlConfig,
    state: GpuState,
    obs: Observation,
    going: frozenset[str],
    now: float,
    actions: list[Action],
) -> tuple[GpuState, bool]:
    """Gating on: relaunch a deep-queue ``--queue auto`` client shallow, before share restarts.

    A deep queue runs on past a freeze, so while one runs gating cannot protect requests and the
    duty cycle and the share stay in charge (:func:`~gpushare.control.gpu_state.gated_shallow`):
    this restart is what lets gating work, so it waits only ``_SHALLOW_RESTART_AFTER_S`` of
    gating on with a busy share measured (the one reading that can turn gating back off), not
    ``share_min_interval``. It goes straight to the share the GPU takes once gated with shallow
    queues (its offline ceiling) when no deep client would be left after such restarts: one
    checkpoint, not a restart to the current share and another to the ceiling. Churn stays
    bounded because the way back is slow: a relaunch deep waits out ``share_min_interval`` of
    gating off (:func:`queue_restart`), so a client makes at most one shallow-deep round trip
    per interval, one client at a time.
    """
    since = state.gating_changed_at_s
    settle = max(_SHALLOW_RESTART_AFTER_S, 2 * config.period_s)
    gate = obs.gate
    if since is None or now - since < settle or gate is None or gate.busy_fraction is None:
        return state, False
    deep = [c for c in obs.offline() if c.state in RESTARTABLE_STATES and not c.shallow]
    movable = [
        c
        for c in deep
        # A live client (issue 32) turns shallow without a restart.
        if c.restartable
        and queue_mode(c.queue) == "auto"
        and not c.live_queue
        and c.client_id not in going
    ]
    if not movable:
        return state, False
    chosen = min(movable, key=lambda c: c.client_id)
    if len(movable) == len(deep):
        top = min(config.offline_sm_pct_max, obs.offline_sm_pct_max)
        target, where = client_share_pct(top, chosen), "at the offline ceiling gating allows"
    else:
        target, where = client_share_pct(state.share_pct, chosen), "under the offline share"
    actions.append(
        RestartClient(
            chosen.client_id,
            target,
            f"--queue auto: request gating on for {now - since:.1f}s, the client runs a deep "
            f"queue a freeze does not stop: checkpoint and relaunch with a shallow one, "
            f"{where} ({target:g}%)",
        )
    )
    return replace(state, restart_pending=(chosen.client_id, now)), True


def queue_restart(
    config: ControlConfig,
    state: GpuState,
    obs: Observation,
    going: frozenset[str],
    now: float,
    actions: list[Action],
) -> GpuState:
    """Gating off: relaunch a shallow ``--queue auto`` client deep, once it has settled.

    Only once gating has been off for ``share_min_interval``: a deep queue only saves the
    launch gap, which can wait, and the wait bounds churn when gating flips at the busy
    threshold. One client at a time like the share's restarts, and never before any share
    restart. (Gating on, :func:`shallow_restart` goes first and does not wait as long.)
    """
    on, since = state.gating_emitted, state.gating_changed_at_s
    if on is not False or since is None or now - since < config.share_min_interval_s:
        return state
    candidates = sorted(
        (
            c
            for c in obs.offline()
            if c.restartable
            and queue_mode(c.queue) == "auto"
            and not c.live_queue  # issue 32: switched live, never restarted for its queue
            and c.shallow
            and c.state in RESTARTABLE_STATES
            and c.client_id not in going
        ),
        key=lambda c: c.client_id,
    )
    if not candidates:
        return state
    chosen = candidates[0]
    actions.append(
        RestartClient(
            chosen.client_id,
            chosen.limits.sm_pct,
            f"--queue auto: request gating off for {now - since:.0f}s, the client runs a "
            "shallow queue: checkpoint and relaunch with a deep one",
        )
    )
    return replace(state, restart_pending=(chosen.client_id, now))


def needs_restart(config: ControlConfig, client: ClientView, share_pct: float) -> bool:
    """Whether ``client``'s SM cap is far enough from its share of ``share_pct`` to restart it."""
    # Above target: always (it crowds online work). Below: only when worth a restart.
    below = client.limits.sm_pct < client_share_pct(share_pct, client) - config.share_hysteresis_pct
    return above_share(share_pct, client) or below
