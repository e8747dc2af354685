"""Real MPS control daemons in front of simulated GPUs (``gpushare daemon --simulate N``).

When NVIDIA's MPS control binary is installed (:func:`gpushare.node.mps.find_binary` finds it;
``scripts/get-mps-control.sh`` puts it in ``.cache/mps``; it runs without a GPU and without
root), the simulated daemon runs one real
control daemon per simulated GPU through the real :class:`gpushare.node.mps.MpsNodeManager`:
the same supervisor, health checks, restarts, default limits and events as on a GPU node.
:class:`HybridMpsNode` joins that real MPS with the simulated node's MPS into one
:class:`gpushare.node.base.MpsNode`:

* ``pipe_dir``: the real daemon's, so every client gets a ``CUDA_MPS_PIPE_DIRECTORY`` on which a
  live control daemon answers.
* ``state``: the real daemon's state unless it is ``up`` (a daemon down, starting or restarting is
  real and gates everything behind it); while it is up, the simulated GPU's (``up``, or ``fault``
  should the model fault). A real daemon without a GPU never starts a working server, so it can
  never report a server fault itself.
* ``drain_events``: the real supervisor's events followed by the simulated node's.
* ``terminate_client`` and ``recover``: both. The real daemon has no server to act on (no GPU), so
  its answer is normally "no such client"; an :class:`~gpushare.node.mps.MpsError` from it is
  logged and never reaches the daemon. ``terminate_client`` succeeds when either side found the
  client (the simulated side holds its GPU work).
* ``stop``: always quits the real daemons, whatever ``daemon.stop_mps_on_exit`` says: they belong
  to GPUs that vanish with the daemon.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

from gpushare.model import MpsEvent, MpsState
from gpushare.node.base import DaemonMpsNode, MpsNode, MultiuserInfo
from gpushare.node.mps import MpsError

log = structlog.get_logger("gpushare.sim")


def merge_state(real: MpsState, simulated: MpsState) -> MpsState:
    """The state of a GPU with a real control daemon in front of a simulated GPU.

    The real daemon's state wins unless it is UP; then the simulated GPU's counts.
    """
    return real if real is not MpsState.UP else simulated


class HybridMpsNode:
    """:class:`gpushare.node.base.MpsNode` of real control daemons over simulated GPUs."""

    #: What answers MPS commands (``gpus[].mps_backend`` in ``gpushare status --json``).
    backend = "real"

    def __init__(self, real: DaemonMpsNode, simulated: MpsNode) -> None:
        """Join ``real`` (one control daemon per simulated GPU) and the simulated node's MPS."""
        self.real = real
        self.simulated = simulated

    @property
    def supervisors(self) -> Mapping[str, MultiuserInfo]:
        """The real per-GPU supervisors (the daemon reads ``multiuser`` from them)."""
        return dict(self.real.supervisors)

    def start(self) -> None:
        """Start the real control daemons.

        Raises:
            MpsError: one could not be started (the ones already started are stopped again).
        """
        self.real.start()

    def stop(self, *, quit_daemon: bool = True) -> None:
        """Quit the real daemons whatever ``quit_daemon`` says: their GPUs end with the daemon."""
        if not quit_daemon:
            log.info("sim_mps_quit", reason="the simulated GPUs end with the daemon")
        self.real.stop(quit_daemon=True)

    def pipe_dir(self, gpu_uuid: str) -> Path:
        """The real control daemon's pipe directory."""
        return self.real.pipe_dir(gpu_uuid)

    def state(self, gpu_uuid: str) -> MpsState:
        """See :func:`merge_state`."""
        return merge_state(self.real.state(gpu_uuid), self.simulated.state(gpu_uuid))

    def drain_events(self, gpu_uuid: str) -> Sequence[MpsEvent]:
        """The real supervisor's events, then the simulated node's."""
        return [*self.real.drain_events(gpu_uuid), *self.simulated.drain_events(gpu_uuid)]

    def terminate_client(self, gpu_uuid: str, client_pid: int) -> bool:
        """Terminate on both sides; True when either found the client."""
        try:
            real_ok = self.real.terminate_client(gpu_uuid, client_pid)
        except MpsError as exc:
            log.warning("sim_mps_terminate_failed", gpu=gpu_uuid, client_pid=client_pid,
                        error=str(exc))  # fmt: skip
            real_ok = False
        return self.simulated.terminate_client(gpu_uuid, client_pid) or real_ok

    def recover(
        self, gpu_uuid: str, offline_pids: Sequence[int], online_pids: Sequence[int]
    ) -> None:
        """Recover on both sides: the real daemon's servers, then the simulated GPU's clients."""
        try:
            self.real.recover(gpu_uuid, offline_pids, online_pids)
        except MpsError as exc:
            log.warning("sim_mps_recover_failed", gpu=gpu_uuid, error=str(exc))
        self.simulated.recover(gpu_uuid, offline_pids, online_pids)
