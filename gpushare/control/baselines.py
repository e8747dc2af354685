"""Baseline sharing policies the simulator compares gpushare's controller against.

Each baseline speaks the same :class:`~gpushare.control.policy.Policy` interface as gpushare's own
controller and uses only the levers a runner has: the per-GPU offline duty fraction
(:class:`~gpushare.model.SetDuty`) and the SM percentage offline clients are launched with
(:class:`~gpushare.model.SetOfflineShare`). They model the mechanism of the system they stand for,
nothing more: none of them evicts, restarts or recovers MPS, because the systems they stand for do
not (``docs/controller.md`` says what each one is and where its constants come from).

``offline_mps_priority`` on every policy tells the runner which ``CUDA_MPS_CLIENT_PRIORITY`` to
launch offline clients with; MPS fixes it at client start, so it is a launch setting, not an action.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpushare.config import ControlConfig
from gpushare.model import Action, Observation, SetDuty, SetOfflineShare

FULL_SHARE_PCT = 100.0


@dataclass(frozen=True, slots=True)
class FixedState:
    """State of the baselines whose decision depends only on this tick (and a tick counter).

    Attributes:
        gpu_uuid: the GPU.
        duty_emitted: the duty last sent (``None`` before the first step).
        share_emitted_pct: the offline share last sent (``None`` before the first step).
        ticks_with_online: consecutive ticks with a live online client (time-slicing's phase).
    """

    gpu_uuid: str
    duty_emitted: float | None = None
    share_emitted_pct: float | None = None
    ticks_with_online: int = 0


def _emit(
    state: FixedState, gpu_uuid: str, duty: float, share_pct: float, why: str
) -> tuple[FixedState, list[Action]]:
    actions: list[Action] = []
    if state.share_emitted_pct != share_pct:
        actions.append(SetOfflineShare(gpu_uuid, share_pct, why))
    if state.duty_emitted != duty:
        actions.append(SetDuty(gpu_uuid, duty, why))
    return replace(state, duty_emitted=duty, share_emitted_pct=share_pct), actions


class ExclusivePolicy:
    """No sharing: offline work waits (duty 0) whenever an online client is live on the GPU.

    This is a GPU given to one workload at a time, with online work first: what clusters without
    sharing do (26-52 % utilisation, docs/design.md §1).
    """

    name = "exclusive"
    offline_mps_priority = 0
    gpu_mode = "mps"
    preemption = None

    def initial_state(self, gpu_uuid: str, now: float) -> FixedState:
        """A GPU not seen before."""
        return FixedState(gpu_uuid)

    def step(
        self, state: FixedState, observation: Observation, now: float
    ) -> tuple[FixedState, Sequence[Action]]:
        """Duty 0 while an online client is live, else 1; offline share 100 %."""
        online = len(observation.online())
        duty = 0.0 if online else 1.0
        why = (
            f"exclusive: {online} online client(s) own the GPU"
            if online
            else "exclusive: no online client, offline runs alone"
        )
        return _emit(state, observation.gpu_uuid, duty, FULL_SHARE_PCT, why)


class TimeSlicingPolicy:
    """Online and offline alternate in fixed slices of ``slice_ticks`` control periods.

    The driver's time-slicing gives each context the whole GPU for a slice in turn (docs/sources.md:
    "nothing special is done to isolate workloads"). On a GPU the driver already time-slices
    (``Observation.time_sliced``: no MPS server shares it) that is the hardware's doing, so the
    policy sends no duty at all: a duty cycle at the control period on top of the driver's
    millisecond slices would be a different, coarser thing. On an MPS GPU it is expressed with
    the runner's levers: while an online client is live the offline duty alternates 0 (online's
    slice) and 1 (offline's slice); online clients keep running in both, as a context switch
    would only delay them by the slice. With no online client offline runs free.
    """

    name = "time-slicing"
    offline_mps_priority = 0
    gpu_mode = "time_slice"
    preemption = None

    def __init__(self, slice_ticks: int = 1) -> None:
        if slice_ticks < 1:
            raise ValueError(f"slice_ticks must be at least 1, got {slice_ticks}")
        self.slice_ticks = slice_ticks

    def initial_state(self, gpu_uuid: str, now: float) -> FixedState:
        """A GPU not seen before."""
        return FixedState(gpu_uuid)

    def step(
        self, state: FixedState, observation: Observation, now: float
    ) -> tuple[FixedState, Sequence[Action]]:
        """Alternate duty 0 and 1 per slice while an online client is live (MPS GPUs only)."""
        if observation.time_sliced:
            return self._hardware_slices(state, observation.gpu_uuid)
        if not observation.online():
            state = replace(state, ticks_with_online=0)
            why = "time-slicing: no online client, offline runs alone"
            return _emit(state, observation.gpu_uuid, 1.0, FULL_SHARE_PCT, why)
        phase = (state.ticks_with_online // self.slice_ticks) % 2
        duty = 0.0 if phase == 0 else 1.0
        state = replace(state, ticks_with_online=state.ticks_with_online + 1)
        why = f"time-slicing: {'online' if phase == 0 else 'offline'} slice"
        return _emit(state, observation.gpu_uuid, duty, FULL_SHARE_PCT, why)

    @staticmethod
    def _hardware_slices(state: FixedState, gpu_uuid: str) -> tuple[FixedState, list[Action]]:
        """The driver slices the GPU: the share uncapped, and no duty beyond releasing one sent."""
        why = "time-slicing: the driver time-slices this GPU"
        actions: list[Action] = []
        if state.share_emitted_pct != FULL_SHARE_PCT:
            actions.append(SetOfflineShare(gpu_uuid, FULL_SHARE_PCT, why))
        if state.duty_emitted is not None and state.duty_emitted != 1.0:
            # Sliced by the policy before the GPU was: a duty left below 1 would starve offline.
            actions.append(SetDuty(gpu_uuid, 1.0, f"{why}: offline duty released"))
        state = replace(
            state, share_emitted_pct=FULL_SHARE_PCT, duty_emitted=None, ticks_with_online=0
        )
        return state, actions


class StaticSharePolicy:
    """Offline clients get a fixed SM percentage and are never throttled.

    With ``share_pct`` 100 this is plain MPS (no caps, k8s-device-plugin with ``replicas`` and no
    limits); below 100 it is a static MPS split (TGS's ``config/test_mps.csv`` 30/70 style,
    k8s-device-plugin's ``100/replicas``). ``offline_mps_priority`` 1 makes it "MPS with client
    priority" (Tally's MPS-priority baseline): the runner launches offline clients with
    ``CUDA_MPS_CLIENT_PRIORITY=1``; the policy itself does not throttle.
    """

    gpu_mode = "mps"
    preemption: str | None = None

    def __init__(self, name: str, share_pct: float, offline_mps_priority: int = 0) -> None:
        if not 0.0 < share_pct <= FULL_SHARE_PCT:
            raise ValueError(f"share_pct must be in (0, 100], got {share_pct}")
        if offline_mps_priority not in (0, 1):
            raise ValueError(f"offline_mps_priority must be 0 or 1, got {offline_mps_priority}")
        self.name = name
        self.share_pct = share_pct
        self.offline_mps_priority = offline_mps_priority

    def initial_state(self, gpu_uuid: str, now: float) -> FixedState:
        """A GPU not seen before."""
        return FixedState(gpu_uuid)

    def step(
        self, state: FixedState, observation: Observation, now: float
    ) -> tuple[FixedState, Sequence[Action]]:
        """Duty 1 and the fixed share, sent once."""
        why = f"{self.name}: fixed offline share {self.share_pct:g}%, never throttled"
        return _emit(state, observation.gpu_uuid, 1.0, self.share_pct, why)


# TGS constants (TGS, docs/sources.md: pkusys/TGS hijack/src/low_priority_hijack_call.c), in TGS's
# unit (thread blocks per 50 ms window) and then normalised to a duty fraction below.
TGS_LIMIT_INITIALIZER = 20_000.0  # L45
TGS_RATE_MIN = 1_000.0  # L46
TGS_THETA = 0.03  # tolerance, L263
TGS_SLOW_START_GAIN = 1.5  # L274, L277
TGS_CA_DECREASE = 0.08  # L290
TGS_RESET_FACTOR = 3.0  # delta >= 3 theta -> slow start, limit / 10 (L295)
TGS_RESET_DIVISOR = 10.0
TGS_BAD_DELTA = 0.12  # L303-L306
TGS_BAD_SAMPLES = 20
TGS_RMAX_DECAY = 0.8
TGS_REPROFILE_DEVIATION = 0.20  # window max deviating > 20 % from r_max -> re-profile
TGS_CADENCE_S = 5.0  # rate_monitor samples every 5000 ms (L138, L184)

# Normalisation: duty 1 = LIMIT_INITIALIZER (TGS starts the low-priority job effectively
# unthrottled; its cap is 2^40 blocks), so RATE_MIN becomes a 5 % duty floor and the congestion
# avoidance step max(0.00025 r_max, RATE_MIN) becomes 0.05 (r_max normalised to 1 makes the first
# term 0.00025, always the smaller).
TGS_DUTY_MIN = TGS_RATE_MIN / TGS_LIMIT_INITIALIZER
TGS_CA_STEP = max(0.00025, TGS_RATE_MIN / TGS_LIMIT_INITIALIZER)
TGS_SLOW_START_ADD = 1.0 / TGS_LIMIT_INITIALIZER  # the "+ 1" of 1.5 * limit + 1


@dataclass(frozen=True, slots=True)
class TgsState:
    """State of the TGS-style rate controller on one GPU.

    Attributes:
        gpu_uuid: the GPU.
        duty: the current limit as a duty fraction.
        slow_start: True in SLOW_START, False in CONGESTION_AVOIDANCE.
        bad_samples: consecutive updates with an error of at least 12 %.
        rmax_scale: r_max relative to the uncontended rate (decays by 0.8 after 20 bad samples).
        last_update_s: when the law last ran (it runs once per 5 s report).
        duty_emitted: the duty last sent.
        share_emitted_pct: the offline share last sent.
    """

    gpu_uuid: str
    duty: float = 1.0
    slow_start: bool = True
    bad_samples: int = 0
    rmax_scale: float = 1.0
    last_update_s: float | None = None
    duty_emitted: float | None = None
    share_emitted_pct: float | None = None


class TgsPolicy:
    """TGS's adaptive rate control (NSDI'23), driven by the latency probe instead of kernel counts.

    Mapping (documented in ``docs/controller.md``): TGS's high-priority rate ``r_HP`` relative to its
    uncontended ``r_max`` becomes ``1 / probe.ratio`` (a probe that takes ``k`` times its baseline
    completes ``1/k`` as many launches), so the error is ``delta = |1/ratio / rmax_scale - 1|``. The
    low-priority limit becomes the duty fraction (see the normalisation constants above). The law
    runs once per ``TGS_CADENCE_S`` as TGS's 5 s reports do; with no online client the limit is
    lifted to its cap (TGS's "HP idle" rule).
    """

    name = "tgs"
    offline_mps_priority = 0
    gpu_mode = "mps"
    preemption = None

    def __init__(self, cadence_s: float = TGS_CADENCE_S) -> None:
        if cadence_s <= 0:
            raise ValueError(f"cadence_s must be positive, got {cadence_s}")
        self.cadence_s = cadence_s

    def initial_state(self, gpu_uuid: str, now: float) -> TgsState:
        """A GPU not seen before: unthrottled, in slow start."""
        return TgsState(gpu_uuid)

    def step(
        self, state: TgsState, observation: Observation, now: float
    ) -> tuple[TgsState, Sequence[Action]]:
        """Run TGS's law when a report is due; emit the duty on change."""
        gpu = observation.gpu_uuid
        actions: list[Action] = []
        if state.share_emitted_pct is None:
            state = replace(state, share_emitted_pct=FULL_SHARE_PCT)
            actions.append(SetOfflineShare(gpu, FULL_SHARE_PCT, "tgs: offline share uncapped"))
        if not observation.online():
            state = replace(state, duty=1.0, slow_start=True, bad_samples=0, last_update_s=None)
            why = "tgs: no online client, limit lifted to cap"
        elif state.last_update_s is not None and now - state.last_update_s < self.cadence_s:
            why = ""
        elif observation.probe.ratio is None or observation.probe.ratio <= 0:
            state = replace(state, last_update_s=now)
            why = ""
        else:
            state, why = self._update(state, observation.probe.ratio, now)
        duty = round(state.duty, 6)
        if duty != state.duty_emitted:
            actions.append(SetDuty(gpu, duty, why or "tgs: limit carried over"))
            state = replace(state, duty_emitted=duty)
        return state, actions

    def _update(self, state: TgsState, ratio: float, now: float) -> tuple[TgsState, str]:
        rel_rate = (1.0 / ratio) / state.rmax_scale
        rmax_scale = state.rmax_scale
        if rel_rate - 1.0 > TGS_REPROFILE_DEVIATION:
            # The online side is faster than r_max allows: TGS re-profiles r_max.
            rmax_scale = 1.0
            rel_rate = 1.0 / ratio
        delta = abs(rel_rate - 1.0)
        duty, slow_start = state.duty, state.slow_start
        if delta >= TGS_RESET_FACTOR * TGS_THETA:
            duty, slow_start, rule = duty / TGS_RESET_DIVISOR, True, "delta >= 3 theta: limit / 10"
        elif slow_start and delta <= TGS_THETA:
            duty, rule = TGS_SLOW_START_GAIN * duty + TGS_SLOW_START_ADD, "slow start: limit x 1.5"
        elif slow_start:
            duty, slow_start = duty / TGS_SLOW_START_GAIN, False
            rule = "slow start over tolerance: limit / 1.5, congestion avoidance"
        elif delta <= TGS_THETA:
            duty, rule = duty + TGS_CA_STEP, "congestion avoidance: additive increase"
        else:
            duty = duty - max(TGS_CA_DECREASE * duty, TGS_CA_STEP)
            rule = "congestion avoidance: limit - 8 %"
        bad = state.bad_samples + 1 if delta >= TGS_BAD_DELTA else 0
        if bad >= TGS_BAD_SAMPLES:
            rmax_scale *= TGS_RMAX_DECAY
            duty, slow_start, bad = duty / 2.0, True, 0
            rule += "; 20 bad samples: r_max x 0.8, limit / 2"
        duty = min(1.0, max(TGS_DUTY_MIN, duty))
        new = replace(
            state,
            duty=duty,
            slow_start=slow_start,
            bad_samples=bad,
            rmax_scale=rmax_scale,
            last_update_s=now,
        )
        return new, f"tgs: probe ratio {ratio:.2f}, error {delta:.1%}: {rule}"


def exclusive(config: ControlConfig) -> ExclusivePolicy:
    """The no-sharing baseline."""
    return ExclusivePolicy()


def time_slicing(config: ControlConfig) -> TimeSlicingPolicy:
    """The time-slicing baseline (one control period per slice)."""
    return TimeSlicingPolicy()


def plain_mps(config: ControlConfig) -> StaticSharePolicy:
    """MPS with no caps and no priority."""
    return StaticSharePolicy("mps", FULL_SHARE_PCT)


def mps_priority(config: ControlConfig) -> StaticSharePolicy:
    """MPS with no caps; offline clients launched at MPS client priority 1."""
    return StaticSharePolicy("mps-priority", FULL_SHARE_PCT, offline_mps_priority=1)


def static_split(config: ControlConfig) -> StaticSharePolicy:
    """MPS with offline clients capped at ``config.offline_sm_pct_default``."""
    return StaticSharePolicy("static-split", config.offline_sm_pct_default)


class TallyLikePolicy(StaticSharePolicy):
    """Kernel-granularity preemption (Tally, docs/sources.md): the upper reference for gating.

    Offline work runs only while the GPU's online clients have no request in flight, one kernel at
    a time, so an online kernel waits at most for the offline kernel already running; offline
    clients run at MPS priority 1 with no SM cap and no duty cycle. The policy's actions are those
    of ``mps-priority``; the preemption is the simulator's (``preemption = "kernel"``, read by
    ``gpushare.sim.runner.PolicyTraits``): MPS cannot preempt, so the daemon refuses this policy.
    """

    preemption = "kernel"
    simulator_only = True

    def __init__(self) -> None:
        super().__init__("tally-like", FULL_SHARE_PCT, offline_mps_priority=1)


def tally_like(config: ControlConfig) -> TallyLikePolicy:
    """The Tally-like reference (simulator only)."""
    return TallyLikePolicy()


def tgs(config: ControlConfig) -> TgsPolicy:
    """The TGS-style rate controller."""
    return TgsPolicy()


__all__ = [
    "ExclusivePolicy",
    "FixedState",
    "StaticSharePolicy",
    "TallyLikePolicy",
    "TgsPolicy",
    "TgsState",
    "TimeSlicingPolicy",
    "exclusive",
    "mps_priority",
    "plain_mps",
    "static_split",
    "tgs",
    "time_slicing",
]
