"""The node's MPS: :class:`MpsNodeManager`, one supervisor per shared GPU (:class:`~gpushare.node.base.MpsNode`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from gpushare.config import Config
from gpushare.model import MpsEvent, MpsState
from gpushare.node.base import ComputeModeControl, DaemonMpsNode
from gpushare.node.mps.errors import MpsError
from gpushare.node.mps.supervisor import MpsSupervisor

log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------------------------
# The node-wide manager (gpushare.node.base.MpsNode)


class MpsNodeManager:
    """One :class:`MpsSupervisor` per shared GPU; implements :class:`gpushare.node.base.MpsNode`."""

    #: What answers MPS commands (``gpus[].mps_backend`` in ``gpushare status --json``).
    backend = "real"

    def __init__(
        self,
        config: Config,
        gpu_uuids: Iterable[str],
        *,
        extra_path: Sequence[str | Path] = (),
        compute_mode: ComputeModeControl | None = None,
        pinned_limits: Mapping[int | str, int | str] | None = None,
        client_priority: int | None = None,
        supervisor_factory: Callable[[str], MpsSupervisor] | None = None,
    ) -> None:
        """Build stopped supervisors for ``gpu_uuids`` (callers pass only the shared GPUs).

        ``pinned_limits`` and ``client_priority`` are the defaults every GPU's daemon gets (see
        :class:`MpsSupervisor`); ``supervisor_factory`` replaces the construction entirely.

        Raises:
            InvalidValue: a bad default. MpsSetupError: a pipe directory path too long.
        """
        self.config = config

        def default_factory(uuid: str) -> MpsSupervisor:
            return MpsSupervisor(
                uuid,
                config,
                extra_path=extra_path,
                compute_mode=compute_mode,
                pinned_limits=pinned_limits,
                client_priority=client_priority,
            )

        factory = supervisor_factory or default_factory
        self.supervisors: dict[str, MpsSupervisor] = {
            u: factory(u) for u in dict.fromkeys(gpu_uuids)
        }
        self._recoveries: dict[str, threading.Thread] = {}

    def _sup(self, gpu_uuid: str) -> MpsSupervisor:
        try:
            return self.supervisors[gpu_uuid]
        except KeyError:
            known = ", ".join(self.supervisors) or "none"
            raise KeyError(f"GPU {gpu_uuid} has no MPS daemon (shared GPUs: {known})") from None

    def start(self) -> None:
        """Start every GPU's daemon; on a failure the ones already started are stopped again.

        Raises:
            MpsError: a daemon could not be started (the message names the GPU).
        """
        started: list[MpsSupervisor] = []
        for uuid, sup in self.supervisors.items():
            try:
                sup.start()
            except MpsError:
                log.exception("mps_start_failed", gpu=uuid)
                for done in started:
                    done.stop()
                raise
            started.append(sup)

    def stop(self, *, quit_daemon: bool = True) -> None:
        """Stop every supervisor (see :meth:`MpsSupervisor.stop`) and wait out any recovery."""
        for sup in self.supervisors.values():
            sup.stop(quit_daemon=quit_daemon)
        # A stopped supervisor ends its recovery's waits at once; what is left is one command.
        for uuid in list(self._recoveries):
            self.wait_recovery(uuid, self.config.mps.ready_timeout_s)

    def pipe_dir(self, gpu_uuid: str) -> Path:
        """The ``CUDA_MPS_PIPE_DIRECTORY`` clients of this GPU must use."""
        return self._sup(gpu_uuid).pipe_dir

    def state(self, gpu_uuid: str) -> MpsState:
        """Health of the GPU's control daemon and server."""
        return self._sup(gpu_uuid).state()

    def drain_events(self, gpu_uuid: str) -> Sequence[MpsEvent]:
        """Events since the last call."""
        return self._sup(gpu_uuid).drain_events()

    def terminate_client(self, gpu_uuid: str, client_pid: int) -> bool:
        """``terminate_client`` on the server the client is connected to; True on success."""
        sup = self._sup(gpu_uuid)
        try:
            spid = sup.server_of(client_pid)
            if spid is None:
                log.warning("mps_terminate_no_server", gpu=gpu_uuid, client_pid=client_pid)
                return False
            sup.control.terminate_client(spid, client_pid)
        except MpsError as exc:
            log.warning("mps_terminate_failed", gpu=gpu_uuid, client_pid=client_pid, error=str(exc))
            return False
        log.info("mps_client_terminated", gpu=gpu_uuid, client_pid=client_pid, server_pid=spid)
        return True

    def recover(
        self, gpu_uuid: str, offline_pids: Sequence[int], online_pids: Sequence[int]
    ) -> None:
        """Start recovering a FAULTed server (offline clients first) on a worker; return at once.

        :meth:`MpsSupervisor.recover` waits up to ``mps.ready_timeout`` twice for the server; run
        inline it would stop the daemon's loop, and so the control of every other GPU and the
        killing of this GPU's offline processes that the recovery waits for. The GPU reads FAULT
        until the recovery clears it. A request while one runs for the GPU is logged and ignored.
        """
        sup = self._sup(gpu_uuid)
        running = self._recoveries.get(gpu_uuid)
        if running is not None and running.is_alive():
            log.info("mps_recovery_in_progress", gpu=gpu_uuid)
            return
        worker = threading.Thread(
            target=self._recover_on_worker,
            args=(sup, tuple(offline_pids), tuple(online_pids)),
            name=f"mps-recover-{gpu_uuid}",
            daemon=True,
        )
        self._recoveries[gpu_uuid] = worker
        worker.start()

    @staticmethod
    def _recover_on_worker(
        sup: MpsSupervisor, offline_pids: Sequence[int], online_pids: Sequence[int]
    ) -> None:
        try:
            ok = sup.recover(offline_pids, online_pids)
        except Exception:  # a worker's crash must be logged, not lost with the thread
            log.exception("mps_recovery_crashed", gpu=sup.gpu_uuid)
            return
        log.info("mps_recovery_finished", gpu=sup.gpu_uuid, ok=ok)

    def wait_recovery(self, gpu_uuid: str, timeout_s: float) -> bool:
        """Wait for the GPU's running recovery, if any; False when it is still running."""
        worker = self._recoveries.get(gpu_uuid)
        if worker is None:
            return True
        worker.join(timeout_s)
        return not worker.is_alive()


if TYPE_CHECKING:  # the adapter implements the Protocol the daemon holds it by

    def _conforms(m: MpsNodeManager) -> DaemonMpsNode:
        return m
