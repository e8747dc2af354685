"""The host's clocks as a :class:`gpushare.node.base.Clock` (the simulator has a virtual one)."""

from __future__ import annotations

import threading
import time


class SystemClock:
    """``time.monotonic`` for ticks and deadlines, ``time.time`` for timestamps."""

    def monotonic(self) -> float:
        """The monotonic clock."""
        return time.monotonic()

    def time(self) -> float:
        """The wall clock."""
        return time.time()

    def sleep_until(self, deadline: float, stop: threading.Event) -> bool:
        """Block until ``deadline`` or a stop request; True when stopped."""
        return stop.wait(max(0.0, deadline - time.monotonic()))
