"""The offline SM share (slow lever): the SM percentage gpushare gives offline (re)launches.

The seventh section of :meth:`~gpushare.control.controller.GpushareController.step`, after request
gating and before the restarts (``docs/controller.md``, "The offline share (slow lever)"). MPS
fixes a client's SM cap at start, so the share applies to new and restarted offline clients
(:mod:`gpushare.control.restarts` relaunches the running ones). :func:`offline_share` recomputes it
from online latency measured while offline work has been quiet for ``quiet_settle`` (the SMs its
SLO leaves, :func:`quiet_level`, with less taken for an LLM server's steps, :func:`_slowdown`; the
SMs online work leaves idle, :func:`quiet_demand`, when online work alone breaks its SLO), split
over the GPU's offline clients, with hysteresis, a minimum interval before a raise, and a cut held
while the duty keeps offline work frozen and the evidence is young (:func:`cut_waits`). Plain
functions of the control config and the GPU's state; pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import replace

from gpushare.config import ControlConfig
from gpushare.control.duty import duty_signals
from gpushare.control.gpu_state import (
    GpuState,
    above_share,
    gated_shallow,
    leaving,
)
from gpushare.control.signals import Signals
from gpushare.model import (
    Action,
    ClientClass,
    ClientView,
    MpsState,
    Observation,
    SetOfflineShare,
)

# Demand samples kept per GPU: one per quiet tick, bounded so a long quiet spell costs no memory.
_MAX_DEMAND_SAMPLES = 600


def offline_share(
    config: ControlConfig,
    state: GpuState,
    obs: Observation,
    signals: Signals,
    now: float,
    actions: list[Action],
) -> GpuState:
    """Record this tick's quiet samples and move the offline share if due; the new state.

    Appends a :class:`SetOfflineShare` on the first step for a GPU, at once when the GPU's
    offline ceiling came down under the share, and when the target moved past
    ``share_hysteresis_pct`` (a lower share at once unless :func:`cut_waits`: offline frozen by
    the duty and this freeze's samples younger than ``quiet_settle``; a higher one after
    ``share_min_interval``), never during an SLO violation or with MPS not up. The target is the
    ceiling with no online client or with request gating on and shallow queues, else what online
    work measured alone leaves (:func:`quiet_level`, or :func:`quiet_demand` when the SLO leaves
    nothing), split over the offline clients.
    """
    cfg = config
    top = min(cfg.offline_sm_pct_max, obs.offline_sm_pct_max)
    low = min(cfg.offline_sm_pct_min, top)
    state = _sample(cfg, state, obs, signals, now)
    since = state.quiet_sampled_since_s
    if not state.share_emitted:
        share = min(top, max(low, state.share_pct))
        why = f"initial offline share {share:g}%"
        if signals.online == 0:
            # The next tick raises it to the ceiling (no online client, no interval to wait):
            # a job admitted meanwhile would be admitted at a share it is then restarted out of.
            share, why = top, f"initial offline share {top:g}%: no online client"
        actions.append(SetOfflineShare(obs.gpu_uuid, share, why))
        return replace(state, share_pct=share, share_emitted=True)
    if state.share_pct > top:
        # The GPU's ceiling came down: it is never exceeded, whatever the interval.
        why = f"offline share {state.share_pct:g}% -> {top:g}%: this GPU's offline ceiling"
        actions.append(SetOfflineShare(obs.gpu_uuid, top, why))
        return replace(state, share_pct=top, share_changed_at_s=now)
    aimed = _target(cfg, state, obs, signals, top)
    if aimed is None:
        return state  # online present, demand or quiet latency not measured: keep the share
    target, basis = aimed
    target = float(math.floor(min(top, max(low, target))))
    target = max(low, target)
    gated = gated_shallow(state, obs)
    # The violation the duty cycle sees (the probe yields to app latency with room, and is not
    # followed at all while gated with shallow queues), not a probe the duty cycle ignores.
    worst = duty_signals(cfg, state, obs, signals).worst
    violating = worst is not None and worst > cfg.violation_ratio
    if target < state.share_pct and cut_waits(config, state, obs, target, now):
        return state
    if target < state.share_pct and state.duty == 0.0 and since is not None:
        basis += f" (sampled for {now - since:.1f} s with offline frozen)"
    # Fast down, slow up: a lower share protects the online SLO and does not wait while offline
    # work runs (cut_waits: it does while the duty holds it frozen); a higher one is
    # opportunistic and waits out the interval (each change restarts restartable clients).
    interval_ok = (
        target < state.share_pct
        or state.share_changed_at_s is None
        or now - state.share_changed_at_s >= cfg.share_min_interval_s
        # Gated, the one move to the ceiling is not opportunistic: no interval to wait out.
        or (gated and target >= top)
    )
    if (
        abs(target - state.share_pct) > cfg.share_hysteresis_pct
        and interval_ok
        and not violating
        and obs.mps_state is MpsState.UP
    ):
        why = f"offline share {state.share_pct:g}% -> {target:g}%: {basis}"
        actions.append(SetOfflineShare(obs.gpu_uuid, target, why))
        state = replace(state, share_pct=target, share_changed_at_s=now)
    return state


def _sample(
    cfg: ControlConfig, state: GpuState, obs: Observation, signals: Signals, now: float
) -> GpuState:
    """``state`` with this tick's quiet samples recorded and the old ones dropped."""
    window = max(cfg.share_min_interval_s, 10 * cfg.period_s)
    samples = tuple(s for s in state.demand_samples if now - s[0] <= window)
    quiet_signals = tuple(s for s in state.quiet_signals if now - s[0] <= window)
    app_quiet = tuple(s for s in state.app_quiet_signals if now - s[0] <= window)
    # A latency window still holds the tail from before the freeze for its whole length: read
    # too early, it says online work alone breaks its SLO, and the share falls to its floor.
    settle_ticks = math.ceil(round(cfg.quiet_settle_s / cfg.period_s, 6))
    sampling = bool(signals.online) and state.quiet_ticks >= max(
        cfg.increase_after_ticks, settle_ticks
    )
    since = state.quiet_sampled_since_s
    since = (now if since is None else since) if sampling else None
    if sampling:
        demand = quiet_demand(cfg, obs, signals)
        if demand is not None:
            samples = (*samples, (now, demand))[-_MAX_DEMAND_SAMPLES:]
        if signals.worst is not None:
            quiet_signals = (*quiet_signals, (now, signals.worst))[-_MAX_DEMAND_SAMPLES:]
        if signals.app_complete and signals.app_worst is not None:
            # Only complete app latency is evidence of the room the app SLOs leave.
            app_quiet = (*app_quiet, (now, signals.app_worst))[-_MAX_DEMAND_SAMPLES:]
    if (
        samples != state.demand_samples
        or quiet_signals != state.quiet_signals
        or app_quiet != state.app_quiet_signals
        or since != state.quiet_sampled_since_s
    ):
        state = replace(
            state,
            demand_samples=samples,
            quiet_signals=quiet_signals,
            app_quiet_signals=app_quiet,
            quiet_sampled_since_s=since,
        )
    return state


def _target(
    cfg: ControlConfig, state: GpuState, obs: Observation, signals: Signals, top: float
) -> tuple[float, str] | None:
    """The share to aim at and why, before the bounds (``None``: nothing measured to aim by)."""
    samples, quiet_signals = state.demand_samples, state.quiet_signals
    if signals.online == 0:
        return top, "no online client"
    if gated_shallow(state, obs):
        # The share bounds what offline work takes from online requests running beside it;
        # gated, it runs only between requests (up to one kernel overlapping a request start).
        return top, "request gating on: offline work runs between online requests"
    if not (samples and quiet_signals):
        return None
    # Both the SM demand and the latency online work has alone are needed as evidence
    # (a share set from SM activity alone overshot before any latency was known).
    quiet, from_app = _share_quiet_level(cfg, state, signals)
    if quiet is not None and quiet < cfg.violation_ratio:
        # Online work held to (100 - s) % of the SMs runs at most 100 / (100 - s) times
        # slower (iGniter: 1.28-1.56x at half the SMs, under the 2x this bound gives), so
        # its p99 stays under the SLO while quiet * 100 / (100 - s) <= violation ratio.
        # This bound alone sets the share: it is the one that follows the SLO. SM demand
        # is a maximum of per-tick averages, which a service at half load reads as ~100 %
        # whenever one tick is busy throughout, whatever its SLO leaves (it held BERT
        # inference at a 2x SLO to the 10 % floor on the simulator).
        slowdown = _slowdown(cfg, obs, from_app)
        target = 100.0 * (1.0 - quiet / cfg.violation_ratio) / slowdown
        basis = (
            f"online alone at {quiet:.2f}x its SLO with offline quiet: to stay "
            f"under the SLO online work needs {quiet / cfg.violation_ratio:.0%} "
            "of the SMs"
        )
        if slowdown < 1.0:
            basis = (
                f"online alone at {quiet:.2f}x its token SLOs with offline quiet: to stay "
                f"under them online work needs {1.0 - target / 100.0:.0%} of the SMs (its "
                f"steps taken to slow by {slowdown:g} of the proportional slowdown on fewer "
                "SMs: token_sm_sensitivity)"
            )
    else:
        # The SLO leaves nothing measurable: fall back on the SMs online work leaves idle.
        demand = max(s for _, s in samples)
        target = 100.0 - demand - cfg.share_headroom_pct
        basis = (
            f"online SM demand {demand:.0f}% measured with offline quiet "
            f"+ {cfg.share_headroom_pct:g}% headroom"
        )
    # MPS caps each client, not offline work as a whole: n offline clients at s % each can
    # hold n x s % of the SMs. The share is what the online clients leave, split evenly.
    # (Gated, offline clients share the time between requests only among themselves.)
    sharing = sum(
        1
        for c in obs.clients
        if c.cls is ClientClass.OFFLINE
        and not c.state.is_final
        and c.client_id not in state.stopped
    )
    if sharing > 1:
        target /= sharing
        basis += f", split over {sharing} offline clients"
    return target, basis


def cut_waits(
    config: ControlConfig, state: GpuState, obs: Observation, target: float, now: float
) -> bool:
    """Whether a cut of the share to ``target`` waits this tick: offline frozen, evidence young.

    A cut waits while the duty decided this tick is 0 (offline work frozen: a share bounds what
    running offline work takes from online work, so while none runs the cut protects nothing
    yet), the quiet samples of this freeze span less than ``quiet_settle`` (the samples are a
    maximum: each new one can lower the target again, and each cut restarts every restartable
    client above it: make demo cut 100 -> 25 -> 10 % on two consecutive ticks), and the cut would
    restart a live restartable offline client (otherwise it costs nothing: it applies at once,
    so a client launched meanwhile starts under it). The duty decided this tick goes first: the
    tick it lets offline work run again, the cut no longer waits and lands in that step.
    """
    if state.duty != 0.0:
        return False
    since = state.quiet_sampled_since_s
    if since is not None and now - since >= config.quiet_settle_s - 1e-9:
        return False
    going = leaving(state)
    return any(
        c.restartable and c.state.is_live and c.client_id not in going and above_share(target, c)
        for c in obs.offline()
    )


def quiet_demand(config: ControlConfig, obs: Observation, signals: Signals) -> float | None:
    """Online SM demand in percent on a quiet tick (offline work frozen or absent).

    100 when the probe is over its SLO (online work alone saturates the GPU), else the SM
    activity, else the GPU utilisation (which overstates demand: errs safe); ``None`` with no
    reading.
    """
    probe = obs.probe.ratio
    if probe is not None and probe > config.probe_slo_ratio:
        return 100.0  # online work alone saturates the GPU: it needs every SM
    sample = obs.sample
    if sample.sm_active_pct is not None:
        return min(100.0, max(0.0, sample.sm_active_pct))
    if sample.gpu_util_pct is not None:
        # Utilisation counts any running kernel, so it overstates demand: errs safe.
        return min(100.0, max(0.0, sample.gpu_util_pct))
    return None


def _slowdown(cfg: ControlConfig, obs: Observation, from_app: bool) -> float:
    """The fraction of the proportional slowdown the share's law assumes for online work.

    ``token_sm_sensitivity`` where the law follows app latency and every live online client
    declares token SLOs only (TTFT, TPOT; no request p99): an LLM server's steps slow by less
    than their share of the SMs (MuxServe's LLaMA-7B steps under MPS thread caps; docs/
    controller.md, "The offline share"). Else 1: a request p99 (iGniter's CNNs and BERT lose
    up to about all of it) and the probe keep the proportional bound.
    """
    online = obs.online()
    if from_app and online and all(_token_slos_only(c) for c in online):
        return cfg.token_sm_sensitivity
    return 1.0


def _token_slos_only(client: ClientView) -> bool:
    """Whether ``client`` declares a TTFT or TPOT SLO and no request p99 SLO."""
    token = client.slo_ttft_p99_ms is not None or client.slo_tpot_p99_ms is not None
    return token and client.slo_p99_ms is None


def _share_quiet_level(
    cfg: ControlConfig, state: GpuState, signals: Signals
) -> tuple[float | None, bool]:
    """The online signal alone the share follows, and whether it is the app's latency.

    The probe is gpushare's evidence for online work that reports no latency of its own; where
    every online client reports its p99 against an SLO (every quiet app sample was complete, and
    no online client is without a report now: the windows of a server at low load are empty at
    times, which is no new client), and those SLOs leave room alone (under ``comfort_ratio``, as
    in the duty cycle's rule, ``duty.duty_signals``), the app latency is what the SLOs are. The
    probe's SLO is the same whatever the app SLOs are, and an LLM server alone (always a batch in
    flight) keeps the probe over it, with spikes of 10-80x behind a long prefill: read as the
    share's evidence, it sent the share to its floor whenever it read, and back up when it did
    not (a server serving alone before a job came: 33 % and 10 % in turn, each cut a restart).
    """
    app = max((v for _, v in state.app_quiet_signals), default=None)
    if (
        app is not None
        and app < cfg.comfort_ratio
        and (signals.app_complete or signals.app_worst is None)
    ):
        return app, True
    return quiet_level(state), False


def quiet_level(state: GpuState) -> float | None:
    """The worst online signal measured with offline work quiet (the largest in the window)."""
    if not state.quiet_signals:
        return None
    return max(v for _, v in state.quiet_signals)
