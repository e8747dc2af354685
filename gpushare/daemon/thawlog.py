"""How long each client was thawed: the last minute's fraction and a running total.

The duty cycle freezes and thaws offline clients up to twice a control period (20 times a second at
the default 100 ms), so keeping every transition would grow with the rate. Instead each client has a
ring of one-second bins holding the thawed seconds that fell into them: memory is fixed per client
(61 floats), the fraction is exact over the bins it covers, and the window it reports over is "the
last minute" to within one bin (60 to 61 s, or less for a client younger than that). Ended clients
are dropped with :meth:`ThawLog.forget`. The state lives in the control loop, never in SQLite: it is
for status and metrics, and a restarted daemon starts it afresh.

Times are the caller's monotonic clock in seconds; calls must not go back in time per client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

WINDOW_S = 60.0
BIN_S = 1.0


@dataclass(slots=True)
class _Track:
    since_s: float
    thawed: bool
    last_s: float
    total_s: float = 0.0
    # bins[i] holds the thawed seconds of bin number ids[i] (a bin number is floor(t / BIN_S)).
    bins: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    # The sum of the stored bins numbered win_first or later, kept as bins fill and expire so a
    # query costs O(1) per tick rather than a pass over every bin.
    win_sum: float = 0.0
    win_first: int = 0


class ThawLog:
    """Per-client thawed time over a sliding window, with bounded memory (one owner, no lock)."""

    def __init__(self, window_s: float = WINDOW_S, bin_s: float = BIN_S) -> None:
        if window_s <= 0 or bin_s <= 0 or bin_s > window_s:
            raise ValueError("ThawLog: need 0 < bin_s <= window_s")
        self.window_s = window_s
        self.bin_s = bin_s
        # One bin more than the window holds: the oldest one is partly outside the window.
        self._nbins = math.ceil(window_s / bin_s) + 1
        self._tracks: dict[str, _Track] = {}

    def set(self, client_id: str, thawed: bool, now: float) -> None:
        """Record the client's state from ``now`` on (starts tracking an unknown client)."""
        track = self._tracks.get(client_id)
        if track is None:
            self._tracks[client_id] = _Track(
                since_s=now,
                thawed=thawed,
                last_s=now,
                bins=[0.0] * self._nbins,
                ids=[-(1 << 62)] * self._nbins,
                win_first=self._bin(now) - self._nbins + 1,
            )
            return
        self._advance(track, now)
        track.thawed = thawed

    def forget(self, client_id: str) -> None:
        """Stop tracking a client (it ended)."""
        self._tracks.pop(client_id, None)

    def clients(self) -> list[str]:
        """The tracked clients."""
        return list(self._tracks)

    def thawed(self, client_id: str) -> bool | None:
        """The client's current state, ``None`` when it is not tracked."""
        track = self._tracks.get(client_id)
        return None if track is None else track.thawed

    def total_s(self, client_id: str, now: float) -> float | None:
        """Seconds the client was thawed since tracking began; ``None`` when not tracked."""
        track = self._tracks.get(client_id)
        if track is None:
            return None
        self._advance(track, now)
        return track.total_s

    def fraction(self, client_id: str, now: float) -> float | None:
        """Fraction of about the last ``window_s`` (whole bins) the client was thawed.

        ``None`` when the client is not tracked; for a client tracked for no time at all yet, its
        current state (1.0 thawed, 0.0 frozen).
        """
        track = self._tracks.get(client_id)
        if track is None:
            return None
        self._advance(track, now)
        first = self._bin(now) - self._nbins + 1
        self._slide(track, first)
        start = max(track.since_s, first * self.bin_s)
        span = now - start
        if span <= 0:
            return 1.0 if track.thawed else 0.0
        return min(1.0, max(0.0, track.win_sum / span))

    def _bin(self, t: float) -> int:
        return math.floor(t / self.bin_s)

    def _slide(self, track: _Track, first: int) -> None:
        """Move the window's start to bin ``first``, dropping the bins that fell out of it."""
        if first <= track.win_first:
            return
        if first - track.win_first >= self._nbins or first // self._nbins != (
            track.win_first // self._nbins
        ):
            # After a long gap, and once per window length anyway (so float error from the
            # running additions and subtractions cannot build up), sum the bins afresh.
            track.win_sum = sum(v for v, i in zip(track.bins, track.ids, strict=True) if i >= first)
        else:
            for b in range(track.win_first, first):
                slot = b % self._nbins
                if track.ids[slot] == b:
                    track.win_sum -= track.bins[slot]
        track.win_first = first

    def _advance(self, track: _Track, now: float) -> None:
        """Account ``[last_s, now)`` in the current state into the total and the bins."""
        start = track.last_s
        if now <= start:
            return
        track.last_s = now
        if not track.thawed:
            return
        track.total_s += now - start
        # Only the last _nbins bins can matter: skip the part of a long gap before them.
        first = max(self._bin(start), self._bin(now) - self._nbins + 1)
        t = max(start, first * self.bin_s)
        b = first
        while t < now:
            end = min(now, (b + 1) * self.bin_s)
            slot = b % self._nbins
            if track.ids[slot] != b:
                if track.ids[slot] >= track.win_first:
                    track.win_sum -= track.bins[slot]  # an old bin leaves the ring
                track.ids[slot] = b
                track.bins[slot] = 0.0
            track.bins[slot] += end - t
            if b >= track.win_first:
                track.win_sum += end - t
            t = end
            b += 1
