"""How a client submitted under ``gpushare daemon --simulate`` names its simulated workload.

Kept apart from :mod:`gpushare.sim.realtime` so that ``gpushare submit`` imports nothing heavy.
"""

from __future__ import annotations

#: Environment variables through which a submitted client carries its simulated workload.
ENV_PROFILE = "GPUSHARE_SIM_PROFILE"
ENV_RPS = "GPUSHARE_SIM_RPS"
ENV_BURST = "GPUSHARE_SIM_BURST"


def workload_env(profile: str, rps: float | None, burst: str | None) -> dict[str, str]:
    """The environment entries ``gpushare submit --sim-profile`` adds to a client."""
    env = {ENV_PROFILE: profile}
    if rps is not None:
        env[ENV_RPS] = repr(float(rps))
    if burst is not None:
        env[ENV_BURST] = burst
    return env
