"""Where ``submit --gpu any`` puts a client, and the memory a GPU still has for one.

NVML shows a client's memory only seconds after it starts (the CUDA context, then its
allocations), so the latest sample alone says "free" about a GPU that the last few submits already
went to: a burst of submits would all land on one GPU. The rule:

* **Available memory** = NVML's free memory minus the memory **promised** to this GPU's clients
  that NVML does not show yet. A live client promises its ``--mem`` less what NVML already
  attributes to it, while it is ``starting`` or ``restarting`` and for ``PROMISE_WINDOW_S`` after
  it started. The promise rule is :mod:`gpushare.control.promise`: the controller's admission of
  queued jobs counts the same promises ("Fit" in ``docs/controller.md``).
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

TIE_BYTES = 1 << 30
"""GPUs whose available memory differs by less than this are equally good for memory.

Idle GPUs of one model differ by MiBs (the driver's and the MPS server's per-GPU use, the
latency probe's context); one CUDA context is about 0.3 to 0.5 GiB. Within 1 GiB the difference is
a context or two, not a reason to stack clients on one GPU while another has fewer."""


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
