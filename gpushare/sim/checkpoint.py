"""What a restart costs a simulated training job: the work since its last checkpoint (issue 32).

A real training job restarted by gpushare (a share change, an eviction, a relaunch) comes back
from its last checkpoint: what it computed since is lost, unless it checkpoints when asked to
stop (the checkpoint signal, ``submit --checkpoint-signal``; ``examples/train_checkpoint.py``).
The simulator charges the start-up (``[gpu] restart``, 60 s by default) and, per offline job
(``[[offline]]`` keys):

* ``checkpoint_on_signal`` (default true): the job saves its state when signalled, losing nothing
  but the iteration in progress (which :meth:`OfflineTrainer.stop` discards anyway);
* ``checkpoint_interval`` (default: none): otherwise, it checkpoints every this long of its run,
  and a restart loses the iterations completed since the last one (all of the run's without an
  interval).

A lost iteration is taken off the job's record, so offline throughput counts only iterations
that survive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpushare.sim.workloads import OfflineTrainer

if TYPE_CHECKING:
    from gpushare.sim.node import SimNode


class Checkpoints:
    """Per simulated job: when its current run began, and the iterations it lost so far."""

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self._run_start: dict[str, float] = {}
        #: Iterations lost to restarts, by job.
        self.lost: dict[str, int] = {}

    def started(self, trainer: OfflineTrainer, now: float) -> None:
        """A run of the job began (from its last checkpoint)."""
        self._run_start[trainer.cid] = now

    def signalled(self, trainer: OfflineTrainer, now: float) -> int:
        """The job is stopped by a signal: drop what it did not save; how many iterations."""
        spec = next((o for o in self.node.scenario.offline if o.name == trainer.cid), None)
        begun = self._run_start.pop(trainer.cid, None)
        if spec is None or begun is None or spec.checkpoint_on_signal:
            return 0
        saved = begun
        interval = spec.checkpoint_interval_s
        if interval is not None and interval > 0:
            saved = begun + int((now - begun) / interval) * interval
        its = trainer.iterations
        keep = len(its)
        while keep > 0 and its[keep - 1] > saved:
            keep -= 1
        lost = len(its) - keep
        del its[keep:]
        if lost:
            self.lost[trainer.cid] = self.lost.get(trainer.cid, 0) + lost
        return lost
