"""Whether one more client fits on a GPU, and if not why: the rule ``submit`` and admission share.

``gpushare submit`` places a new client now (:mod:`gpushare.daemon.api`) and the controller's
admission starts queued offline jobs later (:mod:`gpushare.control.admission`); both describe the
GPU as a :class:`Room` and ask :func:`misfit`, so the same shortage reads the same to a user:

* an MPS client slot must be free (``max_clients`` less the probe's and the live clients');
* without ``-multiuser-server`` MPS serves one user at a time (docs/design.md D11), so no live
  client of another user may be there;
* the client's memory, plus the online reserve for offline work, must fit in the available memory
  (NVML's free memory less what is promised to clients NVML does not show yet, docs/design.md D12),
  and something must be left.

When the GPU is open at all is the caller's (a submit may wait for MPS to come up, admission
needs it up): it passes the reason it is closed. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpushare.model import MpsState
from gpushare.units import format_size

_MIB = 1 << 20
_GIB = 1 << 30

#: Why a lost GPU takes no client.
LOST = "the GPU is lost (see gpushare events)"


def mps_closed(state: MpsState) -> str:
    """Why a GPU whose MPS is in ``state`` takes no client."""
    return f"MPS is {state.value} (see gpushare events)"


@dataclass(frozen=True, slots=True)
class Room:
    """What a GPU has room for, as the asking path counts it.

    Attributes:
        closed: why the GPU takes no client now (lost, MPS down); ``None``: open.
        max_clients: its MPS client slots.
        probe_slots: slots the latency probe takes.
        live: its live clients.
        available_bytes: free memory less the promised; ``None``: unknown (not checked).
        promised_bytes: memory promised to its clients that NVML does not show yet.
        reserve_bytes: memory kept free for online clients that this client must leave (0 for an
            online client).
        other_users: owners of its live clients other than the asker, where MPS serves one user
            at a time (empty under ``-multiuser-server``).
    """

    closed: str | None
    max_clients: int
    probe_slots: int
    live: int
    available_bytes: int | None
    promised_bytes: int = 0
    reserve_bytes: int = 0
    other_users: Sequence[str] = ()


def misfit(room: Room, mem_bytes: int | None) -> str | None:
    """Why a client of ``mem_bytes`` (``None``: not declared) does not fit; ``None`` if it does."""
    if room.closed is not None:
        return room.closed
    if not slot_free(room.max_clients, room.probe_slots, room.live):
        probe = " + the latency probe" if room.probe_slots else ""
        return f"all {room.max_clients} MPS client slots are taken ({room.live} clients{probe})"
    if room.other_users:
        return (
            f"MPS serves one user at a time here and {', '.join(room.other_users)} has clients "
            "running (docs/design.md D11): pick another GPU, wait, or set mps.multiuser"
        )
    if room.available_bytes is None:
        return None
    mem = mem_bytes or 0
    left = room.available_bytes - room.reserve_bytes
    if mem <= left and left > 0:
        return None
    kept = f" with {size(room.reserve_bytes)} kept for online clients" if room.reserve_bytes else ""
    promised = (
        f" after {size(room.promised_bytes)} promised to clients that do not use their --mem yet"
        if room.promised_bytes
        else ""
    )
    free = size(max(0, room.available_bytes))
    return f"needs {size(mem + room.reserve_bytes)}{kept}, {free} free{promised}"


def slot_free(max_clients: int, probe_slots: int, live: int) -> bool:
    """Whether an MPS client slot is free beside the probe's and the live clients'."""
    return live + probe_slots < max_clients


def size(num_bytes: int) -> str:
    """A size for a message: exact when whole MiB (``2G``, ``1536M``), else GiB to 2 decimals."""
    if num_bytes % _MIB == 0:
        return format_size(num_bytes)
    return f"{num_bytes / _GIB:.2f}G"
