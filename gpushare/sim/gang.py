"""Jobs that span GPUs in the simulated node: DDP training gangs and tensor-parallel servers.

Issue 35. Both are built from the one-GPU clients of :mod:`gpushare.sim.workloads`, one per GPU
(a *rank* or a *shard*), tied by a collective that waits for the slowest of them:

* :class:`DdpGang` is data-parallel training (``torchrun --nproc_per_node=N``, PyTorch DDP): every
  rank runs the same iteration on its own GPU; at the iteration's end an all-reduce of the
  gradients waits for every rank and takes ``allreduce_s`` more; only then does any rank issue
  the next iteration. A frozen rank issues nothing, so at the next all-reduce it stalls every
  other rank: the gang's progress is its slowest rank's.
* :class:`TpServer` is a tensor-parallel inference server (vLLM, SGLang with ``TP=N``): a
  request's forward pass runs on every shard at once, each shard doing ``1/N`` of each layer's
  work, with an all-reduce of the activations after every layer (``collective_s``) that waits
  for every shard. A request's latency is its arrival to the last layer's collective.

What is modelled and what is not (docs/simulator.md, "Gangs"): the collective is a wait, not GPU
work: NCCL's kernels hold a few SMs (one per channel) and spin while a peer is late, which this
model leaves out, so it slightly flatters a neighbour of an early rank. DDP's overlap of the
all-reduce with the backward pass is taken into ``allreduce_s`` (the exposed tail, not the whole
transfer).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from gpushare.model import ClientState
from gpushare.sim.data import KernelProfile
from gpushare.sim.gpu import EventLoop, Gpu
from gpushare.sim.workloads import OfflineTrainer, OnlineServer

#: The exposed all-reduce of a DDP iteration (the last gradient bucket, after the backward pass):
#: ResNet-50's 25.6 M fp32 gradients, 102 MB, in 25 MB buckets; the last bucket's ring all-reduce
#: over 8 V100s on NVLink (~130 GB/s bus bandwidth in nccl-tests) is about 0.35 ms, plus the
#: launch and synchronisation; 2 ms is a pessimistic round figure.
DEFAULT_ALLREDUCE_S = 2e-3
#: One small all-reduce of a layer's activations in TP inference (latency-bound, NVLink): NCCL's
#: small-message all-reduce takes some 10-30 us on 8 GPUs.
DEFAULT_COLLECTIVE_S = 20e-6


@dataclass(frozen=True, slots=True)
class DdpSpec:
    """A DDP training job: one rank per GPU in ``gpus``."""

    name: str
    profile: str
    gpus: tuple[int, ...]
    mem_bytes: int = 8 << 30
    allreduce_s: float = DEFAULT_ALLREDUCE_S
    submit_s: float = 1.0


@dataclass(frozen=True, slots=True)
class TpSpec:
    """A tensor-parallel inference server: one shard per GPU in ``gpus``."""

    name: str
    profile: str
    gpus: tuple[int, ...]
    load: float = 0.5
    layers: int = 24
    collective_s: float = DEFAULT_COLLECTIVE_S
    mem_bytes: int = 4 << 30
    slo_factor: float = 1.1


class DdpRank(OfflineTrainer):
    """One rank of a :class:`DdpGang`: an offline trainer that waits for its peers."""

    gang: DdpGang

    def _maybe_issue(self, now: float) -> None:
        # The next iteration waits for the all-reduce that ends this one: a rank that has done
        # more iterations than the gang has released is at the barrier.
        if len(self.iterations) > self.gang.released:
            self.gang.arrived(self, now)
            return
        super()._maybe_issue(now)


class DdpGang:
    """The collective that ties a DDP job's ranks: the all-reduce after every iteration."""

    def __init__(self, ranks: list[DdpRank], allreduce_s: float) -> None:
        self.ranks = ranks
        self.allreduce_s = allreduce_s
        #: Iterations every rank may have started: the gang's own count of iterations.
        self.released = 0
        #: The completion time of every gang iteration (its all-reduce's end).
        self.iterations: list[float] = []
        self._waiting: set[int] = set()
        for r in ranks:
            r.gang = self

    @property
    def name(self) -> str:
        """The job's name (its ranks are ``NAME.rK``)."""
        return self.ranks[0].cid.rsplit(".r", 1)[0]

    def arrived(self, rank: DdpRank, now: float) -> None:
        """``rank`` finished its iteration; the last to finish starts the all-reduce."""
        self._waiting.add(id(rank))
        if len(self._waiting) < len(self.ranks):
            return
        self._waiting.clear()
        loop = rank.gpu.loop
        loop.at(now + self.allreduce_s, self._release, self.released)

    def _release(self, arg: object) -> None:
        if arg != self.released:
            return
        self.released += 1
        now = self.ranks[0].gpu.loop.now
        self.iterations.append(now)
        for r in self.ranks:
            r._maybe_issue(now)  # a frozen rank issues at its thaw
            r.gpu.wake()


class TpShard(OnlineServer):
    """One shard of a :class:`TpServer`: an online client whose requests its group hands out."""

    group: TpServer
    shard: int

    def start(self, loop: EventLoop) -> None:
        """Begin serving; the leader (shard 0) draws the arrivals."""
        self.state = ClientState.RUNNING
        self.started_at_s = loop.now
        self._loop = loop
        if self.shard == 0:
            self._next_arrival()

    def _arrive(self, arg: object) -> None:
        self._next_arrival()
        self.group.arrive(float(arg), self._loop.now)  # type: ignore[arg-type]

    def on_kernel_done(self, now: float) -> None:
        """Advance the request; at a layer's end wait for the collective."""
        self.counts.done += 1
        p = self.pos + 1
        self.pos = p
        if p in self.group.layer_ends:
            self.stream.nxt = None
            self.group.layer_done(p, now)
        else:
            self._present(p, now)


class TpServer:
    """A tensor-parallel server: its shards, its request queue and the per-layer collective."""

    def __init__(self, name: str, shards: list[TpShard], layers: int, collective_s: float) -> None:
        self.name = name
        self.shards = shards
        self.collective_s = collective_s
        n = shards[0]._n
        layers = max(1, min(layers, n))
        #: Chunk positions at which a layer ends (the next layer's first chunk, and ``n``).
        self.layer_ends = frozenset(round(n * (k + 1) / layers) for k in range(layers))
        self.queue: deque[float] = deque()
        self.busy = False
        self._done_shards = 0
        #: (arrival_s, latency_s) of every completed request, shared by every shard (each shard
        #: reports it to the daemon as its own, since the request ran on its GPU too).
        self.completed: list[tuple[float, float]] = []
        self.served: list[tuple[float, float]] = []
        self._current = 0.0
        self._t0 = 0.0
        for k, s in enumerate(shards):
            s.group, s.shard = self, k
            s.completed = self.completed
            s.served = self.served

    def arrive(self, arrival_s: float, now: float) -> None:
        """A request arrives (at the leader); it starts on every shard when the server is free."""
        for s in self.shards:
            if s.on_boundary is not None:
                s.on_boundary(1, now)
        self.queue.append(arrival_s)
        if not self.busy:
            self._begin(now)

    def _begin(self, now: float) -> None:
        if not self.queue or any(s.state is not ClientState.RUNNING for s in self.shards):
            return
        self.busy = True
        self._current = self.queue.popleft()
        self._t0 = now
        for s in self.shards:
            s.current_arrival = self._current
            s._seq_t0 = now
            s.pos = 0
            s._present(0, now)
            s.counts.issued += s._n
            s.gpu.wake()

    def layer_done(self, p: int, now: float) -> None:
        """A shard finished the layer ending at chunk ``p``; the last one starts the collective."""
        self._done_shards += 1
        if self._done_shards < len(self.shards):
            return
        self._done_shards = 0
        self.shards[0].gpu.loop.at(now + self.collective_s, self._after_collective, p)

    def _after_collective(self, arg: object) -> None:
        p = int(arg)  # type: ignore[call-overload]
        now = self.shards[0].gpu.loop.now
        if p >= self.shards[0]._n:
            self.completed.append((self._current, now - self._current))
            self.served.append((self._current, now - self._t0))
            for s in self.shards:
                s.pos = s._n
                if s.on_boundary is not None:
                    s.on_boundary(-1, now)
            self.busy = False
            self._begin(now)
            return
        for s in self.shards:
            s._present(p, now)
            s.gpu.wake()


def shard_profile(profile: KernelProfile, tp: int) -> KernelProfile:
    """A shard's part of a forward pass: each kernel's work split ``tp`` ways.

    Tensor parallelism splits every GEMM's columns or rows across the shards, so each shard's
    kernel does ``1/tp`` of the work with as many blocks as fit (the width stays; the duration
    shrinks). The per-kernel wave detail is dropped (every chunk one wave), as for synthetic
    profiles.
    """
    return KernelProfile(
        name=f"{profile.name}/tp{tp}",
        dur_s=tuple(d / tp for d in profile.dur_s),
        width=profile.width,
        mem=profile.mem,
        source_kernels=profile.source_kernels,
    )


def make_ranks(
    spec: DdpSpec, gpus: list[Gpu], profile: KernelProfile, sm_pct: float
) -> tuple[DdpGang, list[DdpRank]]:
    """The ranks of a DDP job, one per GPU of ``spec.gpus``, tied into a gang."""
    ranks = [
        DdpRank(
            f"{spec.name}.r{k}",
            gpus[g],
            profile,
            sm_pct=sm_pct,
            mem_bytes=spec.mem_bytes,
            restartable=False,  # a lone restarted rank would hang its peers (NCCL has no rejoin)
        )
        for k, g in enumerate(spec.gpus)
    ]
    return DdpGang(ranks, spec.allreduce_s), ranks


def make_shards(
    spec: TpSpec,
    gpus: list[Gpu],
    profile: KernelProfile,
    arrivals: Iterator[float],
    pid_of: Iterator[int],
) -> tuple[TpServer, list[TpShard]]:
    """The shards of a TP server, one per GPU of ``spec.gpus``; shard 0 draws the arrivals."""
    part = shard_profile(profile, len(spec.gpus))
    shards = [
        TpShard(
            f"{spec.name}.s{k}",
            gpus[g],
            part,
            arrivals if k == 0 else iter(()),
            sm_pct=100.0,
            mem_bytes=spec.mem_bytes,
            pid=next(pid_of),
        )
        for k, g in enumerate(spec.gpus)
    ]
    return TpServer(spec.name, shards, spec.layers, spec.collective_s), shards


def tp_alone_s(profile: KernelProfile, spec: TpSpec) -> float:
    """A TP request alone: its shard's kernel time plus one collective per layer.

    The shards issue with no CPU cost per kernel (a server replaying CUDA graphs, as vLLM and
    SGLang do). The load of a TP server is taken against this, as a one-GPU server's is against
    :func:`gpushare.sim.workloads.request_alone_s`.
    """
    return profile.total_s / len(spec.gpus) + spec.layers * spec.collective_s


__all__ = [
    "DdpGang",
    "DdpRank",
    "DdpSpec",
    "TpServer",
    "TpShard",
    "TpSpec",
    "make_ranks",
    "make_shards",
    "shard_profile",
    "tp_alone_s",
]
