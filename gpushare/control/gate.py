"""Request gating, pure: whether a GPU's gated offline clients must be frozen right now.

Online services say when their requests start and end (``gpushare.client.request_started`` /
``request_ended``, or a Prometheus in-flight gauge the daemon polls). While any request is in
flight on a GPU, its **gate** is closed and the GPU's gated offline clients stay frozen; when the
last request ends the gate stays closed for ``[gate] hold`` more (a request arriving right behind
another then finds offline work still frozen, and offline clients are not thawed and frozen again
for a gap shorter than the freeze itself), then opens. Offline work so gets the online service's
idle time without kernel preemption (docs/design.md §2, lever 5).

Every in-flight signal comes from a **source**: one sending process of an online client (its
kernel-verified pid), or one client's gauge. A source reports its current count of requests in
flight; a source whose count is above 0 but which has said nothing for ``[gate]
inflight_timeout`` no longer counts (its process died, hung or lied), so a gate is never closed
longer than ``inflight_timeout`` after the last signal it received (``hold`` is validated to be
shorter). The controller decides per GPU whether gating is on (:func:`set_enabled`, from the
``SetGating`` action); the gate keeps measuring how busy the online work is while it is off, so
the controller can decide on evidence (:func:`busy_fraction`).

**Delay.** The controller also sets a **delay** per GPU (``SetGating.delay_s``): the gate closes
only once the busy spell (requests in flight, or within the hold, without a gap) has lasted that
long. Offline work then runs beside the first ``delay`` of every spell; the spells that last
longer, where requests queue and the tail latency is made, still run alone after it. A spell's
online work is slowed for at most ``delay``, so the tail grows by less than ``delay``: the room a
looser SLO leaves goes to offline work (docs/controller.md, "Gate delay"). Delay 0 is the gate
without it: closed from the first request.

Pure: frozen dataclasses, no I/O, no clock; ``now`` is an argument. The daemon calls
:func:`record` for each datagram (in the receiver thread: that path freezes without waiting for a
control tick) and :func:`evaluate` at :func:`reopens_at`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpushare.config import GateConfig

# A count above this is not a real number of requests in flight in one process: clamp it.
MAX_INFLIGHT = 1_000_000
# Busy-time checkpoints are kept once per this long, so the busy fraction costs O(window).
_CHECKPOINT_S = 1.0


@dataclass(frozen=True, slots=True)
class Source:
    """One in-flight signal of a GPU.

    Attributes:
        key: ``"<client_id>/pid:<pid>"`` for a sending process, ``"<client_id>/gauge"``.
        client_id: the online client it belongs to.
        count: requests it last said were in flight.
        at_s: when it last said anything (its last live signal).
    """

    key: str
    client_id: str
    count: int
    at_s: float


@dataclass(frozen=True, slots=True)
class GateState:
    """One GPU's gate between events.

    Attributes:
        enabled: gating is on (the controller's lever); a disabled gate never closes.
        sources: the in-flight signals, one per source key.
        last_busy_s: the last signal that showed a request in flight or ending (the hold counts
            from it); ``None`` before any.
        busy: requests were in flight (or within the hold) at the last :func:`evaluate`.
        busy_since_s: start of the current busy spell (``None`` when not busy).
        busy_total_s: busy time accumulated over finished spells.
        checkpoints: ``(at_s, busy time up to at_s)``, one per second over the busy window.
        closed: the gate was closed at the last :func:`evaluate` (``enabled and busy`` for
            ``delay_s`` at least).
        changed_at_s: when ``closed`` last changed.
        delay_s: how long a busy spell runs before the gate closes (the controller's lever).
    """

    enabled: bool = False
    sources: tuple[Source, ...] = ()
    last_busy_s: float | None = None
    busy: bool = False
    busy_since_s: float | None = None
    busy_total_s: float = 0.0
    checkpoints: tuple[tuple[float, float], ...] = ()
    closed: bool = False
    changed_at_s: float = 0.0
    delay_s: float = 0.0


def live(source: Source, now: float, config: GateConfig) -> bool:
    """Whether a source holds the gate at ``now``: requests in flight and not timed out."""
    return source.count > 0 and now - source.at_s <= config.inflight_timeout_s


def inflight(state: GateState, now: float, config: GateConfig) -> int:
    """Requests in flight on the GPU at ``now`` (timed-out sources count 0)."""
    return sum(s.count for s in state.sources if live(s, now, config))


def record(state: GateState, client_id: str, key: str, count: int, now: float) -> GateState:
    """A source says it has ``count`` requests in flight (0: its last one ended)."""
    count = min(MAX_INFLIGHT, max(0, count))
    old = next((s for s in state.sources if s.key == key), None)
    rest = tuple(s for s in state.sources if s.key != key)
    was = old is not None and old.count > 0
    last_busy = now if (count > 0 or was) else state.last_busy_s
    # A source at 0 is dropped: that its requests ended is history (the hold keeps it).
    sources = (*rest, Source(key, client_id, count, now)) if count > 0 else rest
    return replace(state, sources=sources, last_busy_s=last_busy)


def knows(state: GateState, key: str) -> bool:
    """Whether a source has requests in flight on record.

    An end from a source not on record is a request-end without a start.
    """
    return any(s.key == key for s in state.sources)


def forget(state: GateState, client_id: str) -> GateState:
    """Drop every source of a client (it exited): its requests no longer hold the gate."""
    return replace(state, sources=tuple(s for s in state.sources if s.client_id != client_id))


def set_enabled(state: GateState, enabled: bool, delay_s: float | None = None) -> GateState:
    """Turn gating on or off, and set its delay unless ``None`` (call :func:`evaluate` after it).

    A negative delay counts as 0. A shorter delay closes a gate whose spell has lasted it at the
    next :func:`evaluate`; a longer one does not reopen a closed gate (the spell it closed on
    already lasted the old delay, and thawing into a queue of requests is what the gate avoids).
    """
    delay = state.delay_s if delay_s is None else max(0.0, delay_s)
    return replace(state, enabled=enabled, delay_s=delay)


def _busy_at(state: GateState, now: float, config: GateConfig) -> bool:
    if any(live(s, now, config) for s in state.sources):
        return True
    return state.last_busy_s is not None and now - state.last_busy_s < config.hold_s


def closes_at(state: GateState) -> float | None:
    """When an open gate closes if the busy spell goes on (``None``: closed, or nothing to close).

    Only a delay makes this later than the request that started the spell; the daemon's gate
    timer evaluates the gate at this time, so the gate closes on time without another signal.
    """
    if not state.enabled or state.closed or state.busy_since_s is None:
        return None
    return state.busy_since_s + state.delay_s


def due_at(state: GateState, config: GateConfig) -> float | None:
    """When :func:`evaluate` next changes the gate without a signal: it closes, or opens."""
    closes = closes_at(state)
    opens = reopens_at(state, config)
    if closes is None:
        return opens
    return closes if opens is None else min(closes, opens)


def reopens_at(state: GateState, config: GateConfig) -> float | None:
    """When the gate opens if no further signal arrives (``None``: no request and no hold).

    The daemon evaluates the gate again at this time, so a hold or a timed-out source ends on
    time without waiting for a control tick.
    """
    ends = [s.at_s + config.inflight_timeout_s for s in state.sources if s.count > 0]
    if state.last_busy_s is not None:
        ends.append(state.last_busy_s + config.hold_s)
    return max(ends) if ends else None


def evaluate(state: GateState, now: float, config: GateConfig) -> GateState:
    """Bring the gate to ``now``: busy or not, closed or open, busy time accounted.

    Sources that timed out are dropped here (they no longer hold the gate).
    """
    spell_end = reopens_at(state, config)
    state = replace(state, sources=tuple(s for s in state.sources if live(s, now, config)))
    busy = _busy_at(state, now, config)
    since, total = state.busy_since_s, state.busy_total_s
    if busy and since is None:
        since = now
    elif not busy and since is not None:
        # The spell ended when the last hold or timeout ran out, which may be before ``now``.
        end = now if spell_end is None else min(now, max(since, spell_end))
        total += max(0.0, end - since)
        since = None
    busy_now = total + (now - since if since is not None else 0.0)
    checkpoints = state.checkpoints
    if not checkpoints or now - checkpoints[-1][0] >= _CHECKPOINT_S:
        keep = now - config.busy_window_s - _CHECKPOINT_S
        checkpoints = (*(c for c in checkpoints if c[0] >= keep), (now, busy_now))
    # Once closed, the gate stays closed to the end of the spell (a longer delay set meanwhile
    # does not reopen it). Float slack: the timer evaluates at ``since + delay`` computed alike.
    closed = (
        state.enabled
        and since is not None
        and (state.closed or now - since >= state.delay_s - 1e-9)
    )
    return replace(
        state,
        busy=busy,
        busy_since_s=since,
        busy_total_s=total,
        checkpoints=checkpoints,
        closed=closed,
        changed_at_s=now if closed != state.closed else state.changed_at_s,
    )


def settled(state: GateState, now: float, config: GateConfig) -> bool:
    """Whether :func:`evaluate` at ``now`` would return ``state`` unchanged.

    True for an open gate with no source, no hold left and no busy-time checkpoint due: the
    daemon's tick then has nothing to evaluate (the common case, every GPU, every tick).
    """
    return (
        not state.sources
        and not state.busy
        and not state.closed
        and state.busy_since_s is None
        and (state.last_busy_s is None or now - state.last_busy_s >= config.hold_s)
        and bool(state.checkpoints)
        and now - state.checkpoints[-1][0] < _CHECKPOINT_S
    )


def busy_fraction(state: GateState, now: float, config: GateConfig) -> float | None:
    """The share of the last ``busy_window`` with requests in flight (or held).

    ``None`` before a second of history.
    """
    busy_now = state.busy_total_s + (
        now - state.busy_since_s if state.busy_since_s is not None else 0.0
    )
    base = next(
        (c for c in state.checkpoints if now - c[0] <= config.busy_window_s),
        None,
    )
    if base is None or now - base[0] < _CHECKPOINT_S:
        return None
    return min(1.0, max(0.0, (busy_now - base[1]) / (now - base[0])))
