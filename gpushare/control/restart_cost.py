"""Whether a share restart pays for itself: the restart cost the controller knows (issue 32).

A restart to apply a new SM share (docs/controller.md, "The offline share", step 4) costs the job
its start-up (imports, data loaders, checkpoint load, warm-up: 30 s to minutes for a real training
job) and, unless it checkpoints on SIGTERM, its work since the last checkpoint. The share rule
used to restart whenever the cap was off target by more than the hysteresis, so a share that
followed request gating on and off restarted the job at each flip (the bursty Azure trace: 5
restarts in 300 s, 60 per job-hour).

The rule here: a restart of a running job pays when, over the time the new share is expected to
hold, the job gains more than the restart costs it. With ``r_now`` its progress rate now (its SM
cap times the GPU's duty: a frozen job makes no progress whatever its cap) and ``r_new`` at the
target (the cap, at duty 1: the share is what the SLO leaves offline work), the job ahead after
``H`` seconds is ``r_new (H - C)`` against ``r_now H``, so the restart pays once

    H > C r_new / (r_new - r_now)                        (the break-even hold)

and never when ``r_new <= r_now``. ``H`` is not known. A cut must hold by itself: its age is the
estimate (a share that flips back within the break-even restarts nothing; while it waits the duty
cycle keeps the SLO, and no restart is asked during an SLO violation anyway). A raise follows
evidence that offline work can have more for a while, so it is expected to hold at least
:data:`RAISE_HOLD_S`. And no job is restarted again within the break-even of its last restart:
churn is bounded per job whatever the share does.

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


def restart_cost_s(config: ControlConfig, client: ClientView) -> float:
    """What a restart costs ``client``: its declared or measured cost, else the config's."""
    if client.restart_cost_s is not None and client.restart_cost_s >= 0:
        return client.restart_cost_s
    return config.restart_cost_s


def break_even_hold_s(current_pct: float, target_pct: float, duty: float, cost_s: float) -> float:
    """How long a new cap must hold for a restart to pay (``inf``: it never does)."""
    if cost_s <= 0:
        return 0.0
    r_now = max(0.0, current_pct) * min(1.0, max(0.0, duty))
    r_new = max(0.0, target_pct)
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
) -> RestartVerdict:
    """Whether restarting ``client`` under ``target_pct`` pays at ``now``.

    ``regime_since_s`` is when the share it would restart into was set (``None``: unknown, taken
    as settled). The hold expected: the regime's age, at least :data:`RAISE_HOLD_S` for a raise.
    A job restarted before is not restarted again within the break-even of its last start.
    """
    cost = restart_cost_s(config, client)
    # Issue 32: a cost the daemon measured says so (gpushare.daemon.startcost).
    costing = _fmt(cost) + (" (measured)" if client.restart_cost_measured else "")
    need = break_even_hold_s(client.limits.sm_pct, target_pct, duty, cost)
    held = now - regime_since_s if regime_since_s is not None else math.inf
    if target_pct > client.limits.sm_pct:
        held = max(held, RAISE_HOLD_S)
    started = client.started_at_s
    ran = now - started if started is not None and client.restarts > 0 else math.inf
    age = min(held, ran)
    if age >= need:
        return RestartVerdict(
            True,
            need,
            f"expected to hold {_fmt(held)}, past the {_fmt(need)} a restart costing "
            f"{costing} needs to pay",
        )
    why = f"held {_fmt(held)}" if ran >= held else f"restarted {_fmt(ran)} ago"
    return RestartVerdict(
        False,
        need,
        f"waits: a restart costing {costing} pays after the new cap holds {_fmt(need)} ({why})",
    )


def _fmt(seconds: float) -> str:
    return "never" if math.isinf(seconds) else f"{seconds:.0f}s"
