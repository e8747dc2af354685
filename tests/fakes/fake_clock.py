"""A clock the test moves: a ``Callable[[], float]`` for the adapters that take one as ``clock``."""

from __future__ import annotations


class ManualClock:
    """Returns :attr:`t` (seconds) until the test changes it."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
