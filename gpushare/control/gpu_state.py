"""The per-GPU state gpushare's controller keeps between ticks, and the helpers its parts share.

:class:`GpuState` is what :class:`~gpushare.control.controller.GpushareController` remembers about
one GPU; the functions here are read by more than one section of the step (the duty cycle, the
share, the restarts) and by the daemon (``failure_backoff_s``), so they live beside the state rather
than in any one section. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpushare.config import ControlConfig
from gpushare.control.restart_cost import DutyTally
from gpushare.control.signals import Signals
from gpushare.model import ClientState, ClientView, Observation

# Client states in which a restart under a new share may be requested (and in which an offline
# client's queue depth decides whether request gating can protect online requests).
RESTARTABLE_STATES = frozenset({ClientState.RUNNING, ClientState.THROTTLED, ClientState.FROZEN})


@dataclass(frozen=True, slots=True)
class GpuState:
    """Everything the controller remembers about one GPU between ticks.

    Attributes:
        gpu_uuid: the GPU.
        duty: the offline duty fraction decided last tick, in [0, 1].
        duty_emitted: the duty last sent to the runner (``None``: nothing sent yet).
        comfortable_ticks: consecutive ticks with every online signal under the comfort ratio.
        breach_duty: the duty when the last SLO violation began (``None``: none since, or the duty
            has since grown past it, or online work left); increases above
            ``duty_decrease_factor`` x this wait ``slow_increase_after_ticks``.
        violation_ticks: consecutive ticks with an online signal over the violation ratio.
        quiet_ticks: consecutive ticks during which offline work was frozen or absent.
        quiet_sampled_since_s: the first tick of the current quiet spell on which online demand
            was sampled (offline quiet for ``quiet_settle``); ``None`` outside such a spell. A
            share cut while the duty is 0 waits until the spell's samples span ``quiet_settle``.
        share_pct: the SM percentage offline (re)launches get.
        share_emitted: whether ``share_pct`` has been sent.
        share_changed_at_s: when the share last changed (``None``: never).
        demand_samples: ``(at_s, online SM demand pct)`` measured while offline work was quiet.
        quiet_signals: ``(at_s, worst normalised online signal)`` measured while offline work was
            quiet: what the SLO leaves when online work runs alone.
        app_quiet_signals: ``(at_s, worst app-reported signal)`` measured on the same ticks: how
            much room the app SLOs leave online work alone (the probe yields to app latency
            only while it is under ``comfort_ratio``).
        evicting: ``(client_id, since_s)`` of clients asked to go away that are still live.
        stopped: clients stopped for repeated failures (never evicted twice).
        restart_pending: ``(client_id, since_s)`` of the restart in flight, if any.
        duty_tally: the offline duty since the share was last set (a restart's verdict reads
            its mean, ``restart_cost.DutyTally``); ``None`` before the restarts' first tick.
        recovering_since_s: start of the MPS fault episode being recovered, if any.
        last_recover_s: when :class:`RecoverMps` was last sent.
        recover_attempts: recoveries sent in this episode (sets the backoff).
        lost: the GPU was reported lost last tick.
        unsignalled_alerted: an alert about online clients without any latency signal was sent.
        memory_alerted: an alert that the reserve cannot be restored was sent.
        gating_emitted: request gating as last sent to the runner (``None``: never sent).
        gating_changed_at_s: when ``gating_emitted`` last changed.
        gated_shallow: last tick, gating was on with no running deep-queue offline client.
        gate_delay_s: the gate's delay decided last tick (docs/controller.md, "Gate delay").
        gate_delay_emitted_s: the delay last sent with ``SetGating``.
        gate_delay_comfortable: consecutive ticks with app latency under ``comfort_ratio`` since
            the delay last changed (a raise waits ``gate_delay_raise_after_ticks`` of them).
        gate_delay_seen_s: the last tick with app latency from every online client (a delay is
            held without it for a while, then dropped).
        gate_delay_breach_s: the delay when app latency last broke its SLO (``None``: none
            since, or the delay has grown past it unharmed); raises past half of it are slow.
        gate_delay_cut_at_s: when the delay was last cut for a breach (one cut per
            ``gate_delay_raise_after_ticks``: the latency window holds the breach a while).
        gate_delay_recent: ``(at_s, worst app signal)`` of the last few seconds, gated (a raise
            needs their tail, not one window's, to leave room).
        gate_delay_history: ``(first_at_s, worst app signal)`` per ``_DELAY_BUCKET_S`` over
            the last ``_DELAY_MEMORY_S`` (gatedelay.py), kept while gating goes off and on: a
            burst seen once keeps capping the room, and its span says how long the tail is known.
        offline_priority: the MPS priority offline launches get, as last sent
            (``SetOfflinePriority``); ``None``: the policy's own (``offline_mps_priority``).
        priority_room_since_s: since when every online client has stayed under
            ``equal_priority_below`` of its SLOs (priority.py); ``None``: not now.
    """

    gpu_uuid: str
    duty: float = 1.0
    duty_emitted: float | None = None
    comfortable_ticks: int = 0
    violation_ticks: int = 0
    quiet_ticks: int = 0
    quiet_sampled_since_s: float | None = None
    share_pct: float = 50.0
    share_emitted: bool = False
    share_changed_at_s: float | None = None
    demand_samples: tuple[tuple[float, float], ...] = ()
    quiet_signals: tuple[tuple[float, float], ...] = ()
    app_quiet_signals: tuple[tuple[float, float], ...] = ()
    breach_duty: float | None = None
    evicting: tuple[tuple[str, float], ...] = ()
    stopped: frozenset[str] = frozenset()
    restart_pending: tuple[str, float] | None = None
    duty_tally: DutyTally | None = None
    recovering_since_s: float | None = None
    last_recover_s: float | None = None
    recover_attempts: int = 0
    lost: bool = False
    unsignalled_alerted: bool = False
    memory_alerted: bool = False
    gating_emitted: bool | None = None
    gating_changed_at_s: float | None = None
    gated_shallow: bool = False
    gate_delay_s: float = 0.0
    gate_delay_emitted_s: float = 0.0
    gate_delay_comfortable: int = 0
    gate_delay_seen_s: float | None = None
    gate_delay_breach_s: float | None = None
    gate_delay_cut_at_s: float | None = None
    gate_delay_recent: tuple[tuple[float, float], ...] = ()
    gate_delay_history: tuple[tuple[float, float], ...] = ()
    offline_priority: int | None = None
    priority_room_since_s: float | None = None


def failure_backoff_s(failures: int, config: ControlConfig) -> float:
    """Delay before a failed offline client is started again: doubles from min to max.

    The daemon sets ``QueuedJob.not_before_s = now + failure_backoff_s(...)`` when it requeues a
    failed client; admission then skips the job until that time.

    Args:
        failures: consecutive failures so far (1 after the first).
        config: the control section (``failure_backoff_min_s``/``failure_backoff_max_s``).
    """
    if failures <= 0:
        return 0.0
    exponent = min(failures - 1, 62)
    return float(min(config.failure_backoff_max_s, config.failure_backoff_min_s * 2.0**exponent))


def client_share_pct(share_pct: float, client: ClientView) -> float:
    """The SM percentage one offline client should run under, given the GPU's offline share.

    A declared ceiling caps it, and so does a gang's other GPUs' smallest share (issue 35: one
    SM share for every rank).
    """
    # Two plain comparisons: called for every offline client on every tick (8 x 200 at idle).
    pct = share_pct
    if client.ceiling_sm_pct is not None and client.ceiling_sm_pct < pct:
        pct = client.ceiling_sm_pct
    if client.gang_share_pct is not None and client.gang_share_pct < pct:
        pct = client.gang_share_pct
    return pct


def above_share(share_pct: float, client: ClientView) -> bool:
    """Whether ``client`` runs above its share of ``share_pct`` (it crowds online work)."""
    return client.limits.sm_pct > client_share_pct(share_pct, client) + 0.5


def leaving(state: GpuState) -> frozenset[str]:
    """Clients being evicted or told to stop: no restart is asked for them."""
    return frozenset(cid for cid, _ in state.evicting) | state.stopped


def gated_shallow(state: GpuState, obs: Observation) -> bool:
    """Request gating is on and no running offline client has a deep queue.

    Then a freeze stops offline work within one kernel of a request's start, and offline work
    runs only between requests: the duty cycle and the SM share have little left to protect.
    """
    # A client starting or restarting is launched with the queue its mode gives under gating
    # (--queue auto: shallow); only one running a deep queue now keeps the duty cycle in charge.
    deep = any(c.state in RESTARTABLE_STATES and not c.shallow for c in obs.offline())
    return state.gating_emitted is True and not deep


def app_only(signals: Signals) -> Signals:
    """The signals with the probe left out: the worst is the app latency's (``None`` without)."""
    return replace(
        signals,
        worst=signals.app_worst,
        worst_source=(
            f"{signals.app_source} (request gating on: the probe is not followed)"
            if signals.app_worst is not None
            else "no app latency (request gating on: the probe is not followed)"
        ),
    )
