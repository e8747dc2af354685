"""Where a gang submit (``submit --gpus``) goes: the GPUs it names, or the ``N`` it asks for.

A gang (docs/design.md §7) runs one rank per GPU and waits for all of them, so it is placed
all-or-nothing: every GPU must fit a rank (the same fit rule as a one-GPU submit, per GPU), or
nothing is placed: an ``--offline`` gang then waits in the queue (:mod:`.submitq`; the
registry's ``gpu_request`` keeps its request as :func:`request_text`), or with ``--no-queue``
the submit is refused with each GPU's reason. ``--gpus N`` takes, of the fitting GPUs, the ``N``
where the gang may run the largest share of the time (docs/design.md D14,
:func:`gpushare.control.gang.place_gang`): each GPU's online clients are one service whose
share ``rho`` is the GPU's measured gate share (:func:`gpushare.control.gang.gpu_services`),
ties to fewer services, more memory, lower indices; the ranks go in index order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from gpushare import protocol
from gpushare.control import placement
from gpushare.control.gang import GpuForGang, gpu_services, place_gang
from gpushare.daemon.registry import ClientRecord
from gpushare.model import ClientClass, GateReading, GpuSample

E = protocol.ErrorCode

#: How a gang's request is recorded (``clients.gpu_request``), apart from ``--gpu``'s index or
#: UUID, neither of which holds ``=``: ``gpus=8`` or ``gpus=GPU-a,GPU-b`` (UUIDs in rank order).
REQUEST_PREFIX = "gpus="


def request_text(n: int, named: Sequence[GpuSample] | None) -> str:
    """The registry's record of a gang's request: its size, or the GPUs it named."""
    return REQUEST_PREFIX + (",".join(g.uuid for g in named) if named else str(n))


def request_of(
    req: protocol.SubmitRequest, gpus: Sequence[GpuSample], resolve: Callable[[str], GpuSample]
) -> str:
    """What a queued job's record keeps of where it may go: ``--gpu``, or a gang's request."""
    if req.gpus is None:
        return req.gpu
    n, named = parse(req.gpus, gpus, resolve)
    return request_text(n, named)


def parse_request(text: str | None) -> tuple[int, tuple[str, ...]] | None:
    """A recorded request (:func:`request_text`): (ranks, named UUIDs); None: not a gang's."""
    if not text or not text.startswith(REQUEST_PREFIX):
        return None
    spec = text[len(REQUEST_PREFIX) :]
    if spec.isascii() and spec.isdigit():
        return int(spec), ()
    uuids = tuple(spec.split(","))
    return len(uuids), uuids


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


def may_ever_fit(g: GpuSample, need_bytes: int, reserve_bytes: int) -> bool:
    """Whether a job of ``need_bytes`` could ever fit on ``g`` beside its online reserve."""
    return g.mem_total_bytes is None or need_bytes + reserve_bytes <= g.mem_total_bytes


def choose(
    n: int,
    fitting: Sequence[GpuSample],
    loads: Mapping[str, placement.GpuLoad],
    problems: Sequence[str],
    named: bool,
    services: Mapping[str, Mapping[str, float]] | None,
) -> list[GpuSample]:
    """The gang's GPUs in rank order, all-or-nothing; ``services`` per GPU UUID (module doc).

    ``services`` None (a gate runs a delay: :func:`services`) takes the one-GPU rule (D12) rank
    by rank instead, as D14 says.

    Raises:
        ProtocolError: NO_CAPACITY with each GPU's reason, when fewer than ``n`` fit (or a named
            one does not).
    """
    if len(fitting) < n or (named and problems):
        why = "; ".join(problems) or "too few GPUs admit new clients"
        raise _fail(E.NO_CAPACITY, f"the gang of {n} GPUs does not fit ({len(fitting)} fit): {why}")
    if named:
        return list(fitting)
    if services is None:
        left, picked = list(fitting), []
        for _ in range(n):
            best = placement.choose([loads[g.uuid] for g in left])
            picked += [g for g in left if g.uuid == best.uuid]
            left = [g for g in left if g.uuid != best.uuid]
        return sorted(picked, key=lambda g: g.index)
    # Every GPU here fits a rank already (the one fit rule): place_gang only chooses among them.
    views = [
        GpuForGang(g.index, loads[g.uuid].available_bytes or 0, services.get(g.uuid, {}))
        for g in fitting
    ]
    placed = place_gang(views, n, 0)
    assert placed is not None  # n <= len(fitting), and every one holds a rank of 0 bytes
    return sorted((g for g in fitting if g.index in placed.gpus), key=lambda g: g.index)


def services(
    records: Iterable[ClientRecord], gpus: Sequence[GpuSample], gate: Callable[[str], GateReading]
) -> dict[str, dict[str, float]] | None:
    """Each GPU's online services for :func:`choose`: its live online clients and its gate share.

    None where a GPU with online clients runs a gate delay: D14 is the rule for gates that close
    on every request; beside a delay offline work runs through short requests and the shares do
    not say what a gang would get (docs/design.md D14), so the one-GPU rule (D12) stands.
    """
    online: dict[str, list[str]] = {g.uuid: [] for g in gpus}
    for r in records:
        if r.cls is ClientClass.ONLINE and r.state.is_live:
            for uuid in r.gpus():
                if uuid in online:
                    online[uuid].append(r.id)
    readings = {uuid: gate(uuid) for uuid, ids in online.items() if ids}
    if any(g.delay_s > 0 for g in readings.values()):
        return None
    return {
        u: gpu_services(ids, readings[u].busy_fraction if ids else None)
        for u, ids in online.items()
    }
