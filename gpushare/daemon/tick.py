"""The time of one control tick, read once and handed to every part the tick runs.

A part that needs "now" during a tick takes it from the :class:`Tick` instead of reading the
clock again, so every decision and record of one tick is made at the same instant (and the
simulator's virtual clock, which does not move within a tick, gives the same values either way).
A part that runs outside the tick (the exit watcher, an API handler) or after a slow action
whose own time it records (a spawn's ``started_at``) still reads the clock itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare.node.base import Clock


@dataclass(frozen=True, slots=True)
class Tick:
    """One instant of the loop: monotonic seconds and wall-clock (epoch) seconds."""

    monotonic_s: float
    wall_s: float

    @classmethod
    def read(cls, clock: Clock) -> Tick:
        """Read both clocks now, monotonic first (the order the loop always read them in)."""
        return cls(clock.monotonic(), clock.time())
