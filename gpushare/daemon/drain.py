"""When a frozen offline client has stopped using the GPU: the drain after a freeze.

Freezing a client's cgroup stops its CPU side at once, but the kernels it already queued still
run: up to one kernel with a shallow queue (``CUDA_LAUNCH_BLOCKING=1``), up to a training
iteration with a deep one (about 100 ms on a whole GPU, several times that under a small SM share
next to online work). Probe samples and latency taken meanwhile are not "online work alone", so
the loop counts a frozen client as quiet only once it has drained:

* **Evidence** (NVML per-process utilisation, :class:`~gpushare.model.SmPeriod`): once the driver
  has listed one of the client's processes using the SMs (so on this host its work is attributed
  to it, not to the MPS server alone), the client has drained when a sampling period that ended
  after its freeze, and after the last period it was busy in, does not list it.
* **Bound**, where there is no such evidence (per-process utilisation unsupported, the client never
  seen in it, or no period has ended since the freeze): :data:`SHALLOW_DRAIN_S` after the freeze
  with a shallow queue, :data:`DEEP_DRAIN_S` with a deep one.

Pure bookkeeping (times are passed in), so it is tested without a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from gpushare.model import SmPeriod

log = structlog.get_logger(__name__)

#: A shallow queue holds one kernel: drained within one control period (a training kernel runs
#: well under 100 ms even at a small share).
SHALLOW_DRAIN_S = 0.1
#: A deep queue holds up to an iteration: ~100 ms on a whole GPU, up to ten times that at a 10 %
#: share next to online work (the simulator's pairs). 1 s also recovered the probe baseline of the
#: bursty Azure trace in the simulator when it was the only drain rule (docs/controller.md).
DEEP_DRAIN_S = 1.0


_EPSILON_S = 1e-9


@dataclass(slots=True)
class _Client:
    frozen_at_s: float  # monotonic time the freeze was seen
    frozen_at_wall_s: float


class DrainTracker:
    """Per client: when it was frozen, whether NVML attributes SM use to it, when it last used SMs.

    Args:
        shallow_s: the bound for a shallow queue.
        deep_s: the bound for a deep queue.
    """

    def __init__(self, shallow_s: float = SHALLOW_DRAIN_S, deep_s: float = DEEP_DRAIN_S) -> None:
        self.shallow_s = shallow_s
        self.deep_s = deep_s
        self._frozen: dict[str, _Client] = {}
        #: Clients NVML has listed using the SMs (their absence from a period then means idle).
        self._attributed: set[str] = set()
        #: Per client, the end (wall s) of the newest period that listed it busy.
        self._busy_wall: dict[str, float] = {}
        #: Per GPU, the end (wall s) of the newest sampling period read.
        self._newest_wall: dict[str, float] = {}

    def note_paused(self, paused: Iterable[str], now: float, wall: float) -> None:
        """The clients frozen now: a newly frozen one starts draining at ``now``."""
        current = set(paused)
        for cid in current - self._frozen.keys():
            self._frozen[cid] = _Client(now, wall)
        for cid in self._frozen.keys() - current:
            del self._frozen[cid]

    def observe(
        self, gpu_uuid: str, periods: Sequence[SmPeriod] | None, pids: Mapping[str, Sequence[int]]
    ) -> None:
        """Read one GPU's new sampling periods; ``pids`` are its offline clients' processes."""
        if not periods:
            return
        owner = {pid: cid for cid, ps in pids.items() for pid in ps}
        for period in periods:
            self._newest_wall[gpu_uuid] = max(
                self._newest_wall.get(gpu_uuid, -math.inf), period.at_wall_s
            )
            for pid in period.pids:
                cid = owner.get(pid)
                if cid is not None:
                    if cid not in self._attributed:
                        # Once per client: on this host NVML attributes SM use to MPS clients.
                        log.info("drain_signal_attributed", client_id=cid, pid=pid)
                        self._attributed.add(cid)
                    self._busy_wall[cid] = max(
                        self._busy_wall.get(cid, -math.inf), period.at_wall_s
                    )

    def drained(self, client_id: str, gpu_uuid: str, now: float, *, shallow: bool) -> bool:
        """Whether a frozen client's queued work has finished (True if it is not frozen)."""
        frozen = self._frozen.get(client_id)
        if frozen is None:
            return False
        newest = self._newest_wall.get(gpu_uuid, -math.inf)
        if client_id in self._attributed and newest > frozen.frozen_at_wall_s:
            # A period ended after the freeze: the client is drained once one did not list it.
            return newest > self._busy_wall.get(client_id, -math.inf)
        bound = self.shallow_s if shallow else self.deep_s
        # A tick's times are sums of periods: 10.1 - 10.0 must count as the 0.1 s it is.
        return now - frozen.frozen_at_s >= bound - _EPSILON_S

    def forget(self, live: Iterable[str]) -> None:
        """Drop what is known of clients that are gone."""
        keep = set(live)
        for d in (self._busy_wall, self._frozen):
            for cid in d.keys() - keep:
                del d[cid]
        self._attributed &= keep
