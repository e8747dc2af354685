"""Where a gang submit (``submit --gpus``) goes: the GPUs it names, or the ``N`` it asks for.

A gang (docs/design.md §7) runs one rank per GPU and waits for all of them, so it is placed
all-or-nothing: every GPU must fit a rank (the same fit rule as a one-GPU submit, per GPU), or
nothing is placed and the submit is refused with each GPU's reason. ``--gpus N`` takes the
fitting GPUs one at a time by the one-GPU rule (:func:`gpushare.control.placement.choose`: the
most available memory, then the fewest clients), in index order for the ranks. D14's placement
by the online services' gate shares (:func:`gpushare.control.gang.place_gang`) is not used yet:
the daemon does not measure each service's ``rho`` for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from gpushare import protocol
from gpushare.control import placement
from gpushare.model import GpuSample

E = protocol.ErrorCode


def _fail(code: protocol.ErrorCode, message: str) -> protocol.ProtocolError:
    return protocol.ProtocolError(code, message)


def parse(
    spec: str, shared: Sequence[GpuSample], resolve: Callable[[str], GpuSample]
) -> tuple[int, list[GpuSample] | None]:
    """``--gpus``: a count (``8``) or a list of GPUs (``0,1`` or UUIDs): (size, the named GPUs).

    Raises:
        ProtocolError: INVALID_PARAMS or NOT_FOUND, one line naming the fix.
    """
    spec = spec.strip()
    if spec.isascii() and spec.isdigit():
        n = int(spec)
        if not 1 <= n <= len(shared):
            raise _fail(
                E.INVALID_PARAMS,
                f"--gpus {spec}: this node shares {len(shared)} GPUs (gpus.shared)",
            )
        return n, None
    keys = [k.strip() for k in spec.split(",")]
    if len(keys) < 2 or not all(keys):
        raise _fail(E.INVALID_PARAMS, f"--gpus {spec!r}: give a count (8) or a list (0,1,2)")
    named = [resolve(k) for k in keys]
    if len({g.uuid for g in named}) != len(named):
        raise _fail(E.INVALID_PARAMS, f"--gpus {spec!r} names a GPU twice")
    shared_ids = {g.uuid for g in shared}
    for g in named:
        if g.uuid not in shared_ids:
            raise _fail(E.INVALID_PARAMS, f"GPU {g.index} is not shared by gpushare (gpus.shared)")
    return len(named), named


def choose(
    n: int,
    fitting: Sequence[GpuSample],
    loads: Mapping[str, placement.GpuLoad],
    problems: Sequence[str],
    named: bool,
) -> list[GpuSample]:
    """The gang's GPUs in rank order, all-or-nothing.

    Raises:
        ProtocolError: NO_CAPACITY with each GPU's reason, when fewer than ``n`` fit (or a named
            one does not).
    """
    if len(fitting) < n or (named and problems):
        why = "; ".join(problems) or "too few GPUs admit new clients"
        raise _fail(
            E.NO_CAPACITY,
            f"the gang of {n} GPUs does not fit ({len(fitting)} fit): {why}; "
            "a gang is not queued, submit it again later",
        )
    if named:
        return list(fitting)
    left = list(fitting)
    picked: list[GpuSample] = []
    for _ in range(n):
        best = placement.choose([loads[g.uuid] for g in left])
        picked.append(next(g for g in left if g.uuid == best.uuid))
        left = [g for g in left if g.uuid != best.uuid]
    return sorted(picked, key=lambda g: g.index)
