"""``--queue auto`` switched live: the in-flight bound written at run time, no restart (issue 32).

The in-flight library reads its bound at every launch from the file named by
``GPUSHARE_INFLIGHT_CONTROL`` (:data:`gpushare.native.CONTROL_ENV`: 4 bytes, little-endian, 0 =
unbounded). So a ``--queue auto`` client launched with the library preloaded and a control file
switches between a shallow queue (bound k) and a deep one (bound 0) when the daemon rewrites the
file, with no checkpoint and no relaunch. There is one file per GPU: the bound follows request
gating, which is per GPU (docs/controller.md, "Shallow offline queues").

* :class:`BoundWriter` is where the bound goes: :class:`ControlFiles` on a host (root's files under
  the runtime directory, readable by every user, whose jobs map them read-only), the simulator's
  own writer in virtual time (``gpushare.sim.inflight_switch``).
* :class:`LiveQueues` is the daemon's side: which clients follow their GPU's file, the
  environment they are launched with (:meth:`LiveQueues.launch_env`), the bound written when
  gating turns on or off (:meth:`LiveQueues.gating`), and since when a client's queue is shallow
  (:meth:`LiveQueues.settled`): kernels queued deep before a switch still run after it, up to an
  iteration, so the drain signal treats such a client as deep until a deep queue's drain bound has
  passed since the switch (:mod:`gpushare.daemon.drain`).

Where clients cannot preload the library (not built, not trusted, a bound-less ``[gate]
shallow_queue = "blocking"``) there is no live switch: ``auto`` falls back to the blocking
shallow queue chosen at each launch, and the controller restarts such a client to switch
(``gpushare.control.restarts``), as before.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Protocol

import structlog

from gpushare.config import GateConfig
from gpushare.native import CONTROL_ENV, INFLIGHT_ENV, LIBRARY_NAME

log = structlog.get_logger(__name__)

#: The control files' directory under the runtime directory.
SUBDIR = "inflight"


class BoundWriter(Protocol):
    """Where a GPU's in-flight bound is written for its live ``--queue auto`` clients."""

    def path(self, gpu_uuid: str) -> str:
        """The control file's path a client of this GPU is launched with (created if needed)."""
        ...

    def write(self, gpu_uuid: str, bound: int) -> None:
        """Set the GPU's bound (0: unbounded); its clients' next launches obey it."""
        ...


def _file_name(gpu_uuid: str) -> str:
    # A GPU UUID is "GPU-<hex and dashes>"; anything else is kept to a safe file name.
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in gpu_uuid) or "gpu"


def control_path(directory: Path, gpu_uuid: str) -> Path:
    """Where :class:`ControlFiles` under ``directory`` keeps the GPU's file."""
    return directory / _file_name(gpu_uuid)


class ControlFiles:
    """:class:`BoundWriter` on a host: one root-owned file per GPU, 0644, in a 0755 directory.

    Every user's job maps its GPU's file read-only (the library opens it ``O_RDONLY``); only root
    can change it. The bound is rewritten in place with ``pwrite`` at offset 0 and the file is
    never truncated: a client reading past the end of its mapping would die of SIGBUS.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fds: dict[str, int] = {}

    def path(self, gpu_uuid: str) -> str:
        """The GPU's file, created holding 0 (unbounded) the first time."""
        self._fd(gpu_uuid)
        return str(control_path(self.directory, gpu_uuid))

    def write(self, gpu_uuid: str, bound: int) -> None:
        """Rewrite the 4 bytes in place."""
        os.pwrite(self._fd(gpu_uuid), struct.pack("<i", max(0, bound)), 0)

    def close(self) -> None:
        """Close the files (they stay: running clients keep their mappings)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, gpu_uuid: str) -> int:
        fd = self._fds.get(gpu_uuid)
        if fd is not None:
            return fd
        self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o755)  # mkdir's mode is masked by the umask
        path = self.directory / _file_name(gpu_uuid)
        # O_NOFOLLOW: a link planted in the directory is never followed (it is root's, so only
        # root could plant one; still, never write through a link as root).
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise OSError(f"{path} is not a regular file")
        os.fchmod(fd, 0o644)
        if st.st_size < 4:
            os.pwrite(fd, struct.pack("<i", 0), 0)
        self._fds[gpu_uuid] = fd
        return fd


class LiveQueues:
    """The daemon's live ``--queue auto`` clients and their GPUs' bounds.

    Args:
        writer: where the bound goes, read at each call (``None``: no live switch).
        shallow: the lifecycle's map of clients running a shallow queue to how
            (``launcher.shallow_how``); kept up to date for the live clients.
    """

    def __init__(
        self, writer: Callable[[], BoundWriter | None], shallow: MutableMapping[str, str]
    ) -> None:
        self._writer = writer
        self._shallow = shallow
        #: Live clients and their GPU.
        self._gpu: dict[str, str] = {}
        #: Per GPU, the bound last written (absent: never written, the file holds 0).
        self._bound: dict[str, int] = {}
        #: Per live client, the controller's time its queue last turned shallow.
        self._shallow_since: dict[str, float] = {}

    def launch_env(
        self,
        client_id: str,
        gpu_uuid: str,
        queue: str | None,
        gating_on: bool,
        gate: GateConfig,
        library: str | None,
        now: float,
    ) -> tuple[dict[str, str], str] | None:
        """The queue variables of a live ``auto`` client and how it runs now; ``None``: not live.

        ``library`` is the in-flight library this launch may preload (already vetted), ``None``
        when it may not: then there is no live switch.
        """
        writer = self._writer()
        if queue != "auto" or writer is None or library is None:
            return None
        if gate.shallow_queue != "bounded":
            return None
        k = gate.inflight_kernels
        try:
            path = writer.path(gpu_uuid)
            self._write(writer, gpu_uuid, k if gating_on else 0)
        except OSError as exc:
            log.warning("inflight_control_failed", gpu=gpu_uuid, error=str(exc))
            return None
        self._gpu[client_id] = gpu_uuid
        self._mark(client_id, gating_on, k, now, launched=True)
        env = {"LD_PRELOAD": library, INFLIGHT_ENV: str(k), CONTROL_ENV: path}
        how = f"{'at most ' + str(k) if gating_on else 'unbounded'} kernels in flight now"
        return env, f"{how}, switched live by {path} ({LIBRARY_NAME})"

    def adopt(self, client_id: str, gpu_uuid: str | None, env: MutableMapping[str, str]) -> bool:
        """A re-adopted client launched with a control file follows its GPU's again."""
        if gpu_uuid is None or CONTROL_ENV not in env or self._writer() is None:
            return False
        self._gpu[client_id] = gpu_uuid
        bound = self._bound.get(gpu_uuid, 0)
        if bound > 0:
            self._shallow[client_id] = f"{bound} in flight"
        else:
            self._shallow.pop(client_id, None)
        return True

    def gating(self, gpu_uuid: str, on: bool, gate: GateConfig, now: float) -> list[str]:
        """Gating turned on or off for a GPU: write its bound; the live clients switched."""
        writer = self._writer()
        if writer is None:
            return []
        k = gate.inflight_kernels
        bound = k if on else 0
        if self._bound.get(gpu_uuid, 0) == bound and gpu_uuid in self._bound:
            return []
        try:
            self._write(writer, gpu_uuid, bound)
        except OSError as exc:
            log.warning("inflight_control_failed", gpu=gpu_uuid, error=str(exc))
            return []
        switched = sorted(cid for cid, gpu in self._gpu.items() if gpu == gpu_uuid)
        for cid in switched:
            self._mark(cid, on, k, now, launched=False)
        if switched:
            log.info("offline_queue_switched", gpu=gpu_uuid, bound=bound, clients=switched)
        return switched

    def is_live(self, client_id: str) -> bool:
        """Whether the client's queue follows its GPU's control file."""
        return client_id in self._gpu

    def settled(self, client_id: str, now: float, deep_drain_s: float) -> bool:
        """Whether a shallow client's queue holds no kernels queued deep before a switch.

        Only a live client switches while it runs; the others are settled. A deep queue drains
        within ``deep_drain_s`` of the switch (an iteration), whatever the bound says since.
        """
        since = self._shallow_since.get(client_id)
        return since is None or now - since >= deep_drain_s

    def forget(self, client_id: str) -> None:
        """The client exited: a relaunch decides its queue anew."""
        self._gpu.pop(client_id, None)
        self._shallow_since.pop(client_id, None)

    def _write(self, writer: BoundWriter, gpu_uuid: str, bound: int) -> None:
        if self._bound.get(gpu_uuid) != bound:
            writer.write(gpu_uuid, bound)
            self._bound[gpu_uuid] = bound

    def _mark(self, client_id: str, on: bool, k: int, now: float, *, launched: bool) -> None:
        if on:
            self._shallow[client_id] = f"{k} in flight"
            if launched:
                self._shallow_since.pop(client_id, None)  # nothing was queued deep
            else:
                self._shallow_since[client_id] = now
        else:
            self._shallow.pop(client_id, None)
            self._shallow_since.pop(client_id, None)
