"""The duty cycle (fast lever): how long each control period gpushare's controller lets offline run.

The fifth section of :meth:`~gpushare.control.controller.GpushareController.step`, after memory
protection (``docs/controller.md``, "The control law (fast lever: duty cycle)"; the probe yielding
to app latency is in "The signals"). :func:`duty_signals` picks the signals the duty follows;
:func:`throttle` runs AIMD on the worst of them with a comfort band, an immediate freeze at the hard
threshold and slow increases near the duty that last broke the SLO. Online clients are never the
target of any throttle action. Plain functions of the control config and the GPU's state; pure: no
I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import replace

from gpushare.config import ControlConfig
from gpushare.control.gpu_state import GpuState, app_only, gated_shallow
from gpushare.control.signals import Signals
from gpushare.model import Action, Alert, Observation, SetDuty, Severity

# Rounding keeps repeated additive steps from drifting (0.05 * 20 must be exactly 1.0).
_DUTY_DIGITS = 6


def duty_signals(
    config: ControlConfig, state: GpuState, obs: Observation, signals: Signals
) -> Signals:
    """The signals the duty cycle follows: the probe yields to app latency while SLOs have room.

    The probe's SLO (``probe_slo_ratio`` x its baseline) is the same whatever the app SLOs
    are, so under a loose app SLO it trips long before the app latency moves. When every
    online client reports its p99 against an SLO, the app SLOs leave room with online work
    alone (worst quiet app signal under ``comfort_ratio``) and the app latency is under
    ``comfort_ratio`` now, the probe counts only at ``hard_ratio``, and not at all where it
    broke its SLO with offline work quiet (the share's quiet samples: a server that always has
    a batch in flight keeps it there); otherwise (an online client without a report, a tight
    SLO, app latency near its SLO) it counts as before.
    """
    cfg = config
    if gated_shallow(state, obs):
        # Gated with shallow queues, offline work runs between requests by design: the probe,
        # which is not a request, meets it there and says nothing of what requests see (it
        # would breach whenever offline work runs). Only app latency counts, when there is any.
        return app_only(signals)
    quiet_app = max((v for _, v in state.app_quiet_signals), default=None)
    # The probe over its SLO with offline work quiet (a server with a batch always in flight:
    # it waits behind the server's own kernels) says nothing of offline work, even at hard_ratio.
    quiet_worst = max((v for _, v in state.quiet_signals), default=0.0)
    ceiling = math.inf if quiet_worst > cfg.violation_ratio else cfg.hard_ratio
    if (
        signals.app_complete
        and signals.app_worst is not None
        and signals.probe is not None
        and quiet_app is not None
        and quiet_app < cfg.comfort_ratio
        and signals.app_worst < cfg.comfort_ratio
        and signals.app_worst < signals.probe < ceiling
    ):
        return replace(
            signals,
            worst=signals.app_worst,
            worst_source=(
                f"{signals.app_source} (the probe at {signals.probe:.2f}x its SLO yields to "
                f"app latency: online alone at {quiet_app:.2f}x its SLO)"
            ),
        )
    return signals


_UNSIGNALLED = (
    "online clients report no latency and the probe has no reading: "
    "the offline duty cycle cannot follow the SLO"
)


def throttle(
    config: ControlConfig,
    state: GpuState,
    obs: Observation,
    signals: Signals,
    actions: list[Action],
) -> GpuState:
    """Move the offline duty on ``signals`` (from :func:`duty_signals`); the new state.

    Appends a :class:`SetDuty` when the duty differs from the one last sent (and one warning
    :class:`Alert` when online clients have no signal at all). The table of
    ``docs/controller.md``, "The control law", is the law; with request gating on and shallow
    queues only the hard ratio cuts. The state object is returned unchanged on a steady tick.
    """
    cfg = config
    duty = state.duty
    breach = state.breach_duty
    # Request gating on: offline work is frozen while online requests are in flight, so what
    # remains of its effect on them is the kernel in flight when a request starts (shallow
    # queue) and the freeze's latency, which a duty cycle does not remove (it only takes the
    # idle time gating hands to offline work). Under a tight SLO, windows of online work alone
    # breach it (docs/benchmarks.md: exclusive use attains 99.4 % at 1.1x); only a breach of
    # the hard ratio, which gating has evidently not contained, cuts the duty then. A client
    # with a deep queue runs up to an iteration past a freeze: the duty cycle works as before.
    gated = gated_shallow(state, obs)
    comfortable, violating = state.comfortable_ticks, state.violation_ticks
    entered = ""
    if gated and not state.gated_shallow:
        # The duty and its breach memory were set without gating (a deep queue, or before
        # gating was on): they say nothing about offline work that runs between requests.
        duty, breach, comfortable, violating = 1.0, None, 0, 0
        entered = "; request gating on with shallow queues: duty reset to 1"
    quiet = state.quiet_ticks + 1 if state.duty_emitted == 0.0 or not obs.offline() else 0
    duty, breach, comfortable, violating, why = _law(
        cfg, signals, gated, duty, breach, comfortable, violating
    )
    if signals.online and signals.worst is None and not gated and not state.unsignalled_alerted:
        actions.append(Alert(obs.gpu_uuid, Severity.WARNING, _UNSIGNALLED))
        state = replace(state, unsignalled_alerted=True)
    duty = round(min(1.0, max(0.0, duty)), _DUTY_DIGITS)
    why += entered
    unsignalled_alerted = state.unsignalled_alerted and not signals.count
    emitted = state.duty_emitted
    if duty != emitted:
        actions.append(SetDuty(obs.gpu_uuid, duty, f"duty {duty:g}: {why}"))
        emitted = duty
    if (
        duty == state.duty
        and comfortable == state.comfortable_ticks
        and violating == state.violation_ticks
        and quiet == state.quiet_ticks
        and breach == state.breach_duty
        and emitted == state.duty_emitted
        and unsignalled_alerted == state.unsignalled_alerted
        and gated == state.gated_shallow
    ):
        return state  # a steady tick (the usual one): no new state
    return replace(
        state,
        duty=duty,
        duty_emitted=emitted,
        comfortable_ticks=comfortable,
        violation_ticks=violating,
        quiet_ticks=quiet,
        breach_duty=breach,
        unsignalled_alerted=unsignalled_alerted,
        gated_shallow=gated,
    )


def _law(
    cfg: ControlConfig,
    signals: Signals,
    gated: bool,
    duty: float,
    breach: float | None,
    comfortable: int,
    violating: int,
) -> tuple[float, float | None, int, int, str]:
    """One step of the control law: ``(duty, breach duty, comfortable, violating, why)``."""
    worst = signals.worst
    if signals.online == 0:
        return 1.0, None, 0, 0, "no online client: offline runs free"
    if worst is None and gated:
        why = "request gating on with shallow queues and no app latency in the window: duty held"
        return duty, breach, 0, 0, why
    if worst is None:
        return (
            duty,
            breach,
            0,
            0,
            f"{signals.online} online client(s) but {signals.describe()}: duty held",
        )
    if worst >= cfg.hard_ratio:
        if violating == 0 and duty > 0:
            breach = duty
        why = f"{signals.describe()} >= hard ratio {cfg.hard_ratio:g}: offline frozen"
        return 0.0, breach, 0, violating + 1, why
    if worst >= cfg.cut_ratio and not gated:
        # A clear breach: the freeze lags by the offline queue, so cut now rather than halve
        # over several ticks; the climb resumes where one decrease would have landed.
        if violating == 0 and duty > 0:
            breach = duty
        why = f"{signals.describe()} >= cut ratio {cfg.cut_ratio:g}: offline frozen"
        return 0.0, breach, 0, violating + 1, why
    if worst > cfg.violation_ratio and not gated:
        if violating == 0 and duty > 0:
            breach = duty
        violating += 1
        duty *= cfg.duty_decrease_factor
        if duty < cfg.duty_increase_step or violating >= cfg.freeze_after_ticks:
            duty = 0.0
        why = (
            f"{signals.describe()} over violation ratio {cfg.violation_ratio:g} "
            f"({violating} tick(s)): duty x {cfg.duty_decrease_factor:g}"
        )
        return duty, breach, 0, violating, why
    if worst < cfg.comfort_ratio:
        comfortable += 1
        why = f"{signals.describe()} under comfort ratio {cfg.comfort_ratio:g}"
        wait = cfg.increase_after_ticks
        if breach is not None and round(duty + cfg.duty_increase_step, _DUTY_DIGITS) > round(
            breach * cfg.duty_decrease_factor, _DUTY_DIGITS
        ):
            # Above where the last decrease landed, each step probes toward the duty that
            # broke the SLO: probe slowly, so breaches (each one costs the p99) stay rare.
            wait = max(wait, cfg.slow_increase_after_ticks)
        if comfortable >= wait:
            duty, comfortable = round(duty + cfg.duty_increase_step, _DUTY_DIGITS), 0
            why += f" for {wait} tick(s): duty + {cfg.duty_increase_step:g}"
            if breach is not None and duty > breach:
                breach = None  # past the duty that broke the SLO, unharmed: conditions changed
        return duty, breach, comfortable, 0, why
    return duty, breach, 0, 0, f"{signals.describe()} inside the comfort band: duty held"
