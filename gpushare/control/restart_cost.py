"""Whether a share restart pays for itself: the restart cost the controller knows (issue 32).

A restart to apply a new SM share (docs/controller.md, "The offline share", step 4) costs the job
its start-up (imports, data loaders, checkpoint load, warm-up: 30 s to minutes for a real training
job) and, unless it checkpoints on SIGTERM, its work since the last checkpoint. The share rule
used to restart whenever the cap was off target by more than the hysteresis, so a share that
followed request gating on and off restarted the job at each flip (the bursty Azure trace: 5
restarts in 300 s, 60 per job-hour).

The rule here: a restart of a running job pays when, over the time the new share is expected to
hold, the job gains more than the restart costs it. With ``r_now`` its progress rate now (its SM
cap times the GPU's duty: a frozen job makes no progress whatever its cap; the duty is its mean
since the share was set, :class:`DutyTally`, not the last tick's) and ``r_new`` at the
target (the cap, at duty 1: the share is what the SLO leaves offline work), the job ahead after
``H`` seconds is ``r_new (H - C)`` against ``r_now H``, so the restart pays once

    H > C r_new / (r_new - r_now)                        (the break-even hold)

and never when ``r_new <= r_now``. The duty at the target is 1 where the share is what the SLO
leaves offline work (at that cap the SLO holds with offline work running), but not where online
work measured alone (offline quiet) sits at or over ``comfort_ratio``: the duty cycle raises the
duty only on ticks under it, so there the duty, not the cap, holds the job back, and a cut frees
nothing. Such a cut is credited the duty the job has now, ``r_new`` is under ``r_now``, and it
never pays (an LLM server busy 98 % of the time at half load: the job frozen at 50 % before the cut
to the 10 % floor stayed frozen after it, and the restart halved its offline throughput). ``H`` is
not known. A cut must hold by itself: its age is the estimate (a share that flips back within the
break-even restarts nothing; while it waits the duty cycle keeps the SLO, and no restart is asked
during an SLO violation anyway). A raise follows evidence that offline work can have more for a
while, so it is expected to hold at least :data:`RAISE_HOLD_S`. And the hold is at most the job's
age since its (re)launch: all the controller knows of the life left to a job is how long it has
run, so no job is restarted within the break-even of its launch. Churn is bounded per job whatever
the share does, and a job just admitted under the share then in force is not restarted out of it
before the restart can pay (a raise when gating turns on a second after admission waits until the
job has run ``H*``).

Why the mean duty: while the duty cycle is in charge it climbs in steps and falls to 0 at each
breach, several times a minute (the hour-long Azure trace from 870 s: 0 -> 0.5 and back every
15-20 s, 0.32 on average). Read on one tick, a cut looked free (``r_now`` 0) whenever its check
fell on a tick at 0: the cut to 33 % was paid for at 1066 s, 76 s after it was set, while the job
ran at 100 % x 0.32 = 32 % on average, for a gain of about 1 point (break-even: some 1,500 s, not
60 s).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpushare.config import ControlConfig
from gpushare.model import ClientView


@dataclass(frozen=True, slots=True)
class RestartVerdict:
    """Whether a restart pays now, and why (the restart's reason or the wait's)."""

    worth: bool
    break_even_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class DutyTally:
    """The offline duty since the share was last set: the integral of a piecewise-constant duty.

    Kept per GPU (``GpuState.duty_tally``) and replaced only when the share or the duty changes.
    """

    since_s: float  # when the share was set (or first seen)
    at_s: float  # when ``duty`` took effect
    duty: float  # the duty in force since ``at_s``
    duty_s: float  # the integral of the duty over [since_s, at_s]

    def mean(self, now: float) -> float:
        """The mean duty over ``[since_s, now]`` (the duty in force when no time has passed)."""
        span = now - self.since_s
        if span <= 0:
            return self.duty
        return (self.duty_s + self.duty * max(0.0, now - self.at_s)) / span


def tally_is_current(tally: DutyTally | None, share_since_s: float | None, duty: float) -> bool:
    """Whether :func:`tally_duty` would return ``tally`` itself: it counts this share and duty."""
    return (
        tally is not None
        and (share_since_s is None or share_since_s == tally.since_s)
        and duty == tally.duty
    )


def tally_duty(
    tally: DutyTally | None, share_since_s: float | None, duty: float, now: float
) -> DutyTally:
    """``tally`` with this tick's duty counted (the same object when nothing changed).

    A share set anew (``share_since_s`` other than the tally's start) starts a new tally; what
    the duty was before the first tick counted is not known: taken as ``duty``.
    """
    if tally is not None and tally_is_current(tally, share_since_s, duty):
        return tally
    if tally is None or (share_since_s is not None and share_since_s != tally.since_s):
        start = now if share_since_s is None else min(now, share_since_s)
        return DutyTally(start, start, duty, 0.0)
    done = tally.duty_s + tally.duty * max(0.0, now - tally.at_s)
    return DutyTally(tally.since_s, now, duty, done)


def restart_cost_s(config: ControlConfig, client: ClientView) -> float:
    """What a restart costs ``client``: its declared or measured cost, else the config's."""
    if client.restart_cost_s is not None and client.restart_cost_s >= 0:
        return client.restart_cost_s
    return config.restart_cost_s


def break_even_hold_s(
    current_pct: float, target_pct: float, duty: float, cost_s: float, new_duty: float = 1.0
) -> float:
    """How long a new cap must hold for a restart to pay (``inf``: it never does).

    ``duty`` is the job's duty under its current cap, ``new_duty`` the one expected at the target.
    """
    if cost_s <= 0:
        return 0.0
    r_now = max(0.0, current_pct) * min(1.0, max(0.0, duty))
    r_new = max(0.0, target_pct) * min(1.0, max(0.0, new_duty))
    if r_new <= r_now:
        return math.inf
    return cost_s * r_new / (r_new - r_now)


#: The hold a raise is expected to have when it has not held longer yet: a raise follows evidence
#: that offline work can have more for a while (request gating on: the service keeps sending
#: request boundaries; online demand measured low, raised at most once per share_min_interval).
#: On the 1-hour Azure code trace a spell of gating on lasts minutes (the longest 187 s, in the
#: 300 s start); ten minutes is that order. A cut has no such prior: it must hold by itself.
RAISE_HOLD_S = 600.0


def verdict(
    config: ControlConfig,
    client: ClientView,
    target_pct: float,
    duty: float,
    regime_since_s: float | None,
    now: float,
    *,
    duty_held_by_online: bool = False,
) -> RestartVerdict:
    """Whether restarting ``client`` under ``target_pct`` pays at ``now``.

    ``duty`` is the offline duty the job has had under its current cap (its mean since the share
    was set, :meth:`DutyTally.mean`). ``duty_held_by_online``: online work measured alone
    (offline quiet) is at or over ``comfort_ratio``, where the duty cycle does not raise the duty,
    so a cut is credited ``duty`` at the target, not 1, and never pays (``restart_cost = 0s``
    aside). ``regime_since_s`` is when the share it would restart into was set (``None``:
    unknown, taken as settled). The hold expected: the regime's age, at least
    :data:`RAISE_HOLD_S` for a raise, and at most the job's age since its (re)launch
    (``started_at_s``): no job is restarted within the break-even of its launch, whether it was
    restarted or admitted then.
    """
    cost = restart_cost_s(config, client)
    # Issue 32: a cost the daemon measured says so (gpushare.daemon.startcost).
    costing = _fmt(cost) + (" (measured)" if client.restart_cost_measured else "")
    cut = target_pct < client.limits.sm_pct
    # Issue 32: beside online work that needs the GPU alone (an LLM server busy 98 % of the
    # time), the duty keeps the job frozen after a cut as before it; only where the SLO leaves
    # offline work room does the job run unfrozen at the new cap.
    frozen_by_online = cut and duty_held_by_online
    new_duty = duty if frozen_by_online else 1.0
    need = break_even_hold_s(client.limits.sm_pct, target_pct, duty, cost, new_duty)
    if frozen_by_online and math.isinf(need):
        return RestartVerdict(
            False,
            need,
            f"waits: online work alone is at or over the comfort ratio, so the duty ({duty:.2f} "
            f"since the share was set), not the cap, holds the job back: a cut to "
            f"{target_pct:g}% frees nothing",
        )
    held = now - regime_since_s if regime_since_s is not None else math.inf
    if target_pct > client.limits.sm_pct:
        held = max(held, RAISE_HOLD_S)
    # The job's age since its (re)launch bounds the hold too: all the controller knows of the
    # life left to a job is how long it has run, and a job is expected to run on at least that
    # long (a scale-free prior: the median of what is left equals the age). So no job is
    # restarted within the break-even of its launch: not one restarted just before, and not
    # one admitted just before under the share then in force (the short genai and Azure
    # traces: admitted at 1 s under 33 %, raised to 100 % by restart when gating turned on
    # 1 s later, and the 60 s restart took the rest of a 50 s run).
    started = client.started_at_s
    ran = now - started if started is not None else math.inf
    age = min(held, ran)
    if age >= need:
        return RestartVerdict(
            True,
            need,
            f"expected to hold {_fmt(age)}, past the {_fmt(need)} a restart costing "
            f"{costing} needs to pay",
        )
    launched = "restarted" if client.restarts > 0 else "launched"
    why = f"held {_fmt(held)}" if ran >= held else f"{launched} {_fmt(ran)} ago"
    return RestartVerdict(
        False,
        need,
        f"waits: a restart costing {costing} pays after the new cap holds {_fmt(need)} ({why})",
    )


def _fmt(seconds: float) -> str:
    return "never" if math.isinf(seconds) else f"{seconds:.0f}s"
