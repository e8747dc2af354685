"""Where ``submit --gpu any`` puts a client, and the memory a GPU still has for one.

NVML shows a client's memory only seconds after it starts (the CUDA context, then its
allocations), so the latest sample alone says "free" about a GPU that the last few submits already
went to: a burst of submits would all land on one GPU. The rule, in the words of the controller's
admission ("Fit" in ``docs/controller.md``: free memory minus the online reserve minus what this
round already placed on the GPU):

* **Available memory** = NVML's free memory minus the memory **promised** to this GPU's clients
  that NVML does not show yet. A live client promises its ``--mem`` less what NVML already
  attributes to it (nothing while NVML lists none of its processes), while it is ``starting`` or
  ``restarting`` and for :data:`PROMISE_WINDOW_S` after it started; after that NVML's reading
  stands alone, so where NVML cannot attribute memory to processes the double count ends. A client
  without ``--mem`` promises nothing: its size is unknown.
* **Fit**: the request's ``--mem`` (plus the online reserve for an offline client) must fit in the
  available memory; the daemon checks it for ``--gpu any`` and for a named GPU alike.
* **Choice** among the fitting GPUs: the most available memory, where GPUs within
  :data:`TIE_BYTES` of the most count as equal; among those the fewest live gpushare clients; then
  the most available memory; then the lowest index. So idle GPUs fill one client each in turn,
  and a GPU that holds much less memory than another is not chosen for its lower client count.

Pure: no I/O, no clock (``now_s`` is an argument), no daemon; the daemon's API builds the inputs
from its registry and the latest NVML sample under its lock, per submit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpushare.model import ClientState

PROMISE_WINDOW_S = 60.0
"""How long after its start a client's unshown ``--mem`` still counts against its GPU.

A CUDA context shows in NVML within about a second of ``cuInit``; a framework (PyTorch, JAX) that
reads its data or builds its model first allocates its working set seconds to tens of seconds
later. A minute covers that start-up and bounds the time a promise is counted twice where NVML
cannot tell whose memory it is (no process list)."""

TIE_BYTES = 1 << 30
"""GPUs whose available memory differs by less than this are equally good for memory.

Idle GPUs of one model differ by MiBs (the driver's and the MPS server's per-GPU use, the
latency probe's context); one CUDA context is about 0.3 to 0.5 GiB. Within 1 GiB the difference is
a context or two, not a reason to stack clients on one GPU while another has fewer."""

_ALWAYS_PROMISING = frozenset({ClientState.STARTING, ClientState.RESTARTING})


@dataclass(frozen=True, slots=True)
class PlacedClient:
    """A live client already on a GPU, as placement sees it.

    Attributes:
        mem_limit_bytes: its ``--mem`` (``None``: not declared).
        state: its registry state.
        started_at_s: when its process started (the registry's clock), ``None`` before.
        mem_used_bytes: the GPU memory NVML attributes to its processes in the latest sample;
            ``None`` when NVML lists none of them.
    """

    mem_limit_bytes: int | None
    state: ClientState
    started_at_s: float | None
    mem_used_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class GpuLoad:
    """One candidate GPU, as placement sees it.

    Attributes:
        index: NVML's index.
        uuid: the GPU's UUID.
        free_bytes: NVML's free memory in the latest sample (``None``: unknown).
        promised_bytes: memory promised to clients NVML does not show yet (:func:`promised_bytes`).
        clients: live gpushare clients on the GPU.
    """

    index: int
    uuid: str
    free_bytes: int | None
    promised_bytes: int = 0
    clients: int = 0

    @property
    def available_bytes(self) -> int | None:
        """Free memory less the promised memory; ``None`` when free memory is unknown."""
        return None if self.free_bytes is None else self.free_bytes - self.promised_bytes


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
    clients: Sequence[PlacedClient], now_s: float, window_s: float = PROMISE_WINDOW_S
) -> int:
    """The memory a GPU's clients were given (``--mem``) and NVML does not show yet."""
    total = 0
    for c in clients:
        if c.mem_limit_bytes is None or not may_promise(c.state, c.started_at_s, now_s, window_s):
            continue
        total += max(0, c.mem_limit_bytes - (c.mem_used_bytes or 0))
    return total


def choose(gpus: Sequence[GpuLoad], tie_bytes: int = TIE_BYTES) -> GpuLoad:
    """The GPU a ``--gpu any`` client goes to among ``gpus`` (all of which fit it).

    The most available memory, within ``tie_bytes`` counted as equal; then the fewest clients; then
    the most available memory; then the lowest index. A GPU of unknown free memory is chosen only
    when no GPU's free memory is known.
    """
    if not gpus:
        raise ValueError("no GPU to choose from")
    known = [(g, a) for g in gpus if (a := g.available_bytes) is not None]
    if known:
        best = max(a for _, a in known)
        near = [(g, a) for g, a in known if a >= best - tie_bytes]
    else:
        near = [(g, 0) for g in gpus]
    return min(near, key=lambda ga: (ga[0].clients, -ga[1], ga[0].index))[0]
