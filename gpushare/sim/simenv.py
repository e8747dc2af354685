"""How a client submitted under ``gpushare daemon --simulate`` names its simulated workload.

Kept apart from :mod:`gpushare.sim.realtime` so that ``gpushare submit`` imports nothing heavy.
"""

from __future__ import annotations

import math

#: Environment variables through which a submitted client carries its simulated workload.
ENV_PROFILE = "GPUSHARE_SIM_PROFILE"
ENV_RPS = "GPUSHARE_SIM_RPS"
ENV_BURST = "GPUSHARE_SIM_BURST"

#: The highest request rate one simulated service may ask for, bursts included. The simulated
#: node runs in the daemon's real time: every request is an event it must simulate before the
#: daemon's next tick (``--rps 1e12`` hung the daemon), and a simulated GPU serves a few hundred
#: requests a second of the shipped profiles, so a rate above this only fills a queue.
MAX_SIM_RPS = 5000.0


def rate_problem(rps: float | None, burst: tuple[float, float, float] | None) -> str | None:
    """Why a simulated rate (and burst) cannot run, in one line; ``None`` when it can."""
    if rps is not None and not (math.isfinite(rps) and 0 < rps <= MAX_SIM_RPS):
        return f"--rps must be a number of requests per second in (0, {MAX_SIM_RPS:g}], got {rps!r}"
    if burst is not None:
        at_s, for_s, factor = burst
        if not all(math.isfinite(x) for x in burst) or at_s < 0 or for_s <= 0 or factor <= 0:
            return "--sim-burst is AT_S:FOR_S:FACTOR with finite positive numbers"
        if rps is not None and rps * factor > MAX_SIM_RPS:
            return (
                f"--sim-burst {factor:g}x of --rps {rps:g} asks for {rps * factor:g} requests per"
                f" second; at most {MAX_SIM_RPS:g}"
            )
    return None


def workload_env(profile: str, rps: float | None, burst: str | None) -> dict[str, str]:
    """The environment entries ``gpushare submit --sim-profile`` adds to a client."""
    env = {ENV_PROFILE: profile}
    if rps is not None:
        env[ENV_RPS] = repr(float(rps))
    if burst is not None:
        env[ENV_BURST] = burst
    return env
