"""Memory promised to a GPU's clients that NVML does not show yet (docs/design.md D12).

NVML shows a client's memory only seconds after it starts (the CUDA context, then its
allocations), so the latest sample alone says "free" about a GPU that the last few placements
already went to. Both placements count what the GPU's clients were promised:
``submit --gpu any`` and a named GPU in the daemon (:mod:`gpushare.control.placement`), and the
controller's admission of queued offline jobs (:mod:`gpushare.control.admission`), which on the
next tick would otherwise see the same stale free memory and start a second job beside the first.

The rule: a live client promises its ``--mem`` less what NVML already attributes to its processes
(nothing while NVML lists none of them), while it is ``starting`` or ``restarting`` and for
:data:`PROMISE_WINDOW_S` after it started; after that NVML's reading stands alone, so where NVML
cannot attribute memory to processes the double count ends. A client without ``--mem`` promises
nothing: its size is unknown. A GPU's **available memory** is NVML's free memory minus the sum.

Pure: no I/O, no clock (``now_s`` is an argument, on the same clock as the clients' start times).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpushare.model import ClientState, ClientView

PROMISE_WINDOW_S = 60.0
"""How long after its start a client's unshown ``--mem`` still counts against its GPU.

A CUDA context shows in NVML within about a second of ``cuInit``; a framework (PyTorch, JAX) that
reads its data or builds its model first allocates its working set seconds to tens of seconds
later. A minute covers that start-up and bounds the time a promise is counted twice where NVML
cannot tell whose memory it is (no process list)."""

_ALWAYS_PROMISING = frozenset({ClientState.STARTING, ClientState.RESTARTING})


@dataclass(frozen=True, slots=True)
class PlacedClient:
    """A client on a GPU, as far as its promise goes.

    Attributes:
        mem_limit_bytes: its ``--mem`` (``None``: not declared).
        state: its registry state.
        started_at_s: when its process started (the caller's clock), ``None`` before.
        mem_used_bytes: the GPU memory NVML attributes to its processes in the latest sample;
            ``None`` when NVML lists none of them.
    """

    mem_limit_bytes: int | None
    state: ClientState
    started_at_s: float | None
    mem_used_bytes: int | None = None

    @classmethod
    def of(cls, view: ClientView) -> PlacedClient:
        """The controller's view of a client: its ``--mem`` is its pinned-memory limit."""
        return cls(view.limits.pinned_mem_bytes, view.state, view.started_at_s, view.mem_used_bytes)


def may_promise(
    state: ClientState, started_at_s: float | None, now_s: float, window_s: float = PROMISE_WINDOW_S
) -> bool:
    """Whether a client may still hold memory NVML does not show: starting, or started lately."""
    if not state.is_live:
        return False
    if state in _ALWAYS_PROMISING:
        return True
    # A running client with no start time is an old record: NVML's reading stands.
    return started_at_s is not None and now_s - started_at_s < window_s


def promised_bytes(
    clients: Iterable[PlacedClient], now_s: float, window_s: float = PROMISE_WINDOW_S
) -> int:
    """The memory a GPU's clients were given (``--mem``) and NVML does not show yet."""
    total = 0
    for c in clients:
        if c.mem_limit_bytes is None or not may_promise(c.state, c.started_at_s, now_s, window_s):
            continue
        total += max(0, c.mem_limit_bytes - (c.mem_used_bytes or 0))
    return total


def promised_to_views(
    views: Iterable[ClientView], now_s: float, window_s: float = PROMISE_WINDOW_S
) -> int:
    """:func:`promised_bytes` of an observation's clients (the controller's ``now``)."""
    return promised_bytes((PlacedClient.of(v) for v in views), now_s, window_s)
