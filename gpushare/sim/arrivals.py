"""When requests arrive at a simulated online service: Poisson, bursty, trace replays.

:func:`arrivals_for` picks the process a scenario's ``[[online]]`` asks for: a Poisson process at
its rate (with an optional burst), a replay of an Azure LLM trace (thinned to its rate), or a
non-homogeneous Poisson process following an Alibaba GenAI per-minute series. Each yields arrival
times in virtual seconds, ascending, until ``end_s``.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Iterator

from gpushare.sim import data
from gpushare.sim.scenario import OnlineSpec


def arrivals_for(spec: OnlineSpec, standalone_s: float, seed: int, end_s: float) -> Iterator[float]:
    """The arrival process of an online service."""
    if spec.arrivals == "poisson":
        rps = spec.rps if spec.rps is not None else (spec.load or 0.5) / standalone_s
        if spec.burst is not None:
            return bursty_poisson_arrivals(rps, spec.burst, seed, 0.0, end_s)
        return poisson_arrivals(rps, seed, end_s)
    assert spec.trace is not None
    if spec.arrivals == "azure":
        times = data.load_azure_arrivals(spec.trace)
        span = times[-1] - times[0] or 1.0
        mean_rps = len(times) / span * spec.trace_speedup
        want = spec.rps if spec.rps is not None else (spec.load or 0.5) / standalone_s
        scale = min(1.0, want / mean_rps) if mean_rps > 0 else 1.0
        return trace_arrivals(
            times,
            start_s=spec.trace_start_s,
            speedup=spec.trace_speedup,
            rate_scale=scale,
            end_s=end_s,
        )
    series = data.load_genai_qps(spec.trace)
    start_bin = int(spec.trace_start_s // 60)
    series = series[start_bin:] or series
    peak = spec.rps if spec.rps is not None else (spec.load or 0.5) / standalone_s
    return rate_series_arrivals(series, bin_s=spec.bin_s, peak_rps=peak, seed=seed, end_s=end_s)


def poisson_arrivals(rate_per_s: float, seed: int, end_s: float) -> Iterator[float]:
    """Open-loop Poisson arrivals at ``rate_per_s`` until ``end_s``."""
    rng = random.Random(seed)
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= end_s:
            return
        yield t


def bursty_poisson_arrivals(
    rps: float,
    burst: tuple[float, float, float] | None,
    seed: int,
    start_s: float,
    end_s: float,
) -> Iterator[float]:
    """Poisson arrivals at ``rps`` from ``start_s``, with an optional burst.

    ``burst = (at_s, for_s, factor)`` multiplies the rate by ``factor`` from ``at_s`` (relative to
    ``start_s``) for ``for_s``.
    """
    rng = random.Random(seed)
    t = 0.0
    lo, length, factor = burst if burst is not None else (math.inf, 0.0, 1.0)
    hi = lo + length
    while True:
        rate = rps * factor if lo <= t < hi else rps
        step = rng.expovariate(rate)
        # Memorylessness: a draw that crosses a rate boundary restarts at the boundary.
        edge = lo if t < lo else hi if t < hi else math.inf
        if t + step > edge:
            t = edge
            continue
        t += step
        if start_s + t >= end_s:
            return
        yield start_s + t


def trace_arrivals(
    times_s: tuple[float, ...], *, start_s: float, speedup: float, rate_scale: float, end_s: float
) -> Iterator[float]:
    """Replay a recorded arrival trace from ``start_s``, ``speedup`` times faster.

    ``rate_scale`` thins (< 1) the trace deterministically to scale its mean rate; it must be <= 1.
    """
    i = bisect.bisect_left(times_s, start_s)
    acc = 0.0
    while i < len(times_s):
        t = (times_s[i] - start_s) / speedup
        if t >= end_s:
            return
        acc += rate_scale
        if acc >= 1.0:
            acc -= 1.0
            yield t
        i += 1


def rate_series_arrivals(
    per_bin: tuple[float, ...], *, bin_s: float, peak_rps: float, seed: int, end_s: float
) -> Iterator[float]:
    """A non-homogeneous Poisson process whose rate follows ``per_bin`` scaled to ``peak_rps``.

    Each bin of the series lasts ``bin_s`` of virtual time (the series is compressed in time).
    """
    rng = random.Random(seed)
    peak = max(per_bin) or 1.0
    t = 0.0
    b = 0
    while b < len(per_bin):
        rate = per_bin[b] / peak * peak_rps
        bin_end = (b + 1) * bin_s
        t = min(t + rng.expovariate(rate), bin_end) if rate > 0.0 else bin_end
        if t >= end_s:
            return
        if t >= bin_end:
            # Memorylessness: restart the draw at the next bin's start with its own rate (a
            # quiet bin's long draw must not end the process before the busy bins after it).
            b += 1
            continue
        yield t
