"""``gpushare drain`` and ``undrain``: GPUs that admit nothing new, kept across daemon restarts.

Named after Kubernetes' *cordon* (mark unschedulable, let what runs finish) so as not to be
confused with :mod:`gpushare.daemon.drain`, the control loop's wait for a frozen client's queued
kernels. On a cordoned GPU:

* a submit that names it is refused, with who drained it, since when, why, and the command that
  ends it; ``--gpu any`` skips it (every shared GPU drained: refused the same way);
* queued jobs wait (``status`` and ``list`` show why) instead of being started there;
* what runs there carries on: clients finish, or their owners checkpoint and cancel them. A
  restart of a running restartable client (a share change) is that client going on, not a new
  admission, so it is allowed; adoption still registers processes that run there anyway, so
  they stay under control.

Only root and the admin group may drain or undrain: it changes what every user may do. The set
is written to ``<state_dir>/drained.json`` (mode 0600, atomically) at each change and read at
start, so a restart keeps it. A file that cannot be read is reported and counts as no drain: the
operator sees it in the event log and can drain again.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from gpushare import protocol
from gpushare.daemon.server import Caller
from gpushare.model import GpuSample, QueuedJob
from gpushare.node.procs.users import user_in_group, user_name

if TYPE_CHECKING:
    from gpushare.daemon.state import NodeState

log = structlog.get_logger(__name__)

FILE_NAME = "drained.json"
_MAX_REASON = 200
E = protocol.ErrorCode


@dataclass(frozen=True, slots=True)
class Cordon:
    """One drained GPU: who drained it, when (wall clock, s since the epoch) and why."""

    gpu_uuid: str
    since_wall_s: float
    by_user: str
    reason: str = ""

    def describe(self, index: int | None) -> str:
        """One line for a refusal: which GPU, who, since when, why, and how it ends."""
        name = f"GPU {index}" if index is not None else self.gpu_uuid
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since_wall_s))
        why = f": {self.reason}" if self.reason else ""
        gpu = f" --gpu {index}" if index is not None else ""
        return (
            f"{name} is draining (by {self.by_user} since {when}{why}): nothing new starts there; "
            f"`gpushare undrain{gpu}` ends it"
        )


@dataclass(frozen=True, slots=True)
class DrainRequest:
    """``drain``: one GPU by index or UUID, or every shared GPU."""

    gpu: str | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class UndrainRequest:
    """``undrain``: one GPU by index or UUID, or every drained GPU."""

    gpu: str | None = None


class Cordons:
    """The drained GPUs, mirrored to ``path``; safe to use from the API's threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._by_uuid: dict[str, Cordon] = {}
        #: Why the file could not be read at start (the daemon turns it into an event).
        self.load_error: str | None = None
        self._load()

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            cordons = [Cordon(**item) for item in raw["drained"]]
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, KeyError) as exc:
            self.load_error = f"{self.path} cannot be read, so no GPU counts as drained: {exc}"
            log.warning("drained_file_unreadable", path=str(self.path), error=str(exc))
            return
        self._by_uuid = {c.gpu_uuid: c for c in cordons}

    def _save(self) -> None:
        data = {"drained": [asdict(c) for c in sorted(self._by_uuid.values(),
                                                       key=lambda c: c.gpu_uuid)]}  # fmt: skip
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def get(self, gpu_uuid: str) -> Cordon | None:
        """The cordon of ``gpu_uuid``, if it is drained."""
        with self._lock:
            return self._by_uuid.get(gpu_uuid)

    def drained(self) -> set[str]:
        """The UUIDs of the drained GPUs."""
        with self._lock:
            return set(self._by_uuid)

    def set(self, add: Sequence[Cordon] = (), remove: Sequence[str] = ()) -> None:
        """Drain and undrain GPUs, then write the file; nothing changes if it cannot be written.

        Raises:
            OSError: the file could not be written (the set in memory is left as it was).
        """
        with self._lock:
            before = dict(self._by_uuid)
            for c in add:
                self._by_uuid.setdefault(c.gpu_uuid, c)
            for uuid in remove:
                self._by_uuid.pop(uuid, None)
            try:
                self._save()
            except OSError:
                self._by_uuid = before
                raise


def held_by_drain(
    jobs: Sequence[QueuedJob],
    waiting: Mapping[str, str],
    samples: Sequence[GpuSample],
    drained: set[str],
    open_gpus: Mapping[str, object],
) -> dict[str, str]:
    """Why each waiting queued job waits because of a drain (admission saw only open GPUs)."""
    if not drained:
        return {}
    index = {x.uuid: x.index for x in samples}
    out = {}
    for job in jobs:
        pinned = next((u for u, i in index.items() if job.gpu in (u, str(i))), None)
        if pinned is None:  # a gang that named a draining GPU waits for it (issue 35)
            pinned = next((u for u in job.gang_gpus if u in drained), None)
        if job.client_id not in waiting:
            continue
        if pinned in drained:
            out[job.client_id] = f"GPU {index[pinned]} is draining (gpushare undrain)"
        elif pinned is None and not open_gpus:
            out[job.client_id] = "every GPU is draining (gpushare undrain)"
    return out


def is_admin(caller: Caller, admin_group: str) -> bool:
    """Root, or a member of the admin group (by the connection's groups or the group database)."""
    if caller.uid == 0:
        return True
    if not admin_group:
        return False
    with contextlib.suppress(KeyError):
        gid = grp.getgrnam(admin_group).gr_gid
        if gid == caller.gid or gid in caller.groups:
            return True
    return user_in_group(caller.uid, admin_group)


def _fail(code: protocol.ErrorCode, message: str) -> protocol.ProtocolError:
    return protocol.ProtocolError(code, message)


class CordonApi:
    """The ``drain`` and ``undrain`` handlers.

    Args:
        cordons: the drained set.
        shared_gpus: the node's shared GPUs now (from the last sample).
        resolve_gpu: a GPU by index or UUID (raises the API's not-found error).
        admin_group: the config's admin group now.
        event: adds an event to the registry (kind, message).
    """

    def __init__(
        self,
        cordons: Cordons,
        shared_gpus: Callable[[], list[GpuSample]],
        resolve_gpu: Callable[[str], GpuSample],
        admin_group: Callable[[], str],
        event: Callable[[str, str], object],
    ) -> None:
        self.cordons = cordons
        self._shared = shared_gpus
        self._resolve = resolve_gpu
        self._admin_group = admin_group
        self._event = event

    @classmethod
    def of(cls, state: NodeState, resolve_gpu: Callable[[str], GpuSample]) -> CordonApi:
        """The handlers for the daemon's shared state."""
        return cls(
            state.cordons,
            shared_gpus=lambda: [g for g in state.samples if state.shared(g)],
            resolve_gpu=resolve_gpu,
            admin_group=lambda: state.config.daemon.admin_group,
            event=lambda kind, message: state.registry.add_event(kind, message),
        )

    def admitting(self, gpus: Sequence[GpuSample], *, named: bool = False) -> list[GpuSample]:
        """The GPUs of ``gpus`` a submit may go to (``named``: the one its ``--gpu`` names).

        Raises:
            ProtocolError: every one is drained (UNAVAILABLE; the line says who, why, the fix).
        """
        open_gpus = [g for g in gpus if self.cordons.get(g.uuid) is None]
        if open_gpus:
            return open_gpus
        if named and (c := self.cordons.get(gpus[0].uuid)) is not None:
            raise _fail(E.UNAVAILABLE, c.describe(gpus[0].index))
        raise _fail(E.UNAVAILABLE, "every shared GPU is draining: nothing new starts; "
                    "`gpushare undrain` ends it")  # fmt: skip

    def _targets(self, caller: Caller, gpu: str | None, what: str) -> list[GpuSample]:
        if not is_admin(caller, self._admin_group()):
            group = self._admin_group()
            raise _fail(
                E.PERMISSION_DENIED,
                f"{user_name(caller.uid)} may not {what} GPUs: only root"
                + (f" or members of group {group!r}" if group else "")
                + " may",
            )
        if gpu is not None:
            return [self._resolve(gpu)]
        return self._shared()

    def drain(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``drain``: admit nothing new on one GPU or every shared GPU."""
        req = protocol.from_params(DrainRequest, params)
        reason = req.reason.strip()
        if len(reason) > _MAX_REASON or not reason.isprintable():
            raise _fail(E.INVALID_PARAMS, f"--reason must be printable, at most {_MAX_REASON}")
        gpus = self._targets(caller, req.gpu, "drain")
        new = [g for g in gpus if self.cordons.get(g.uuid) is None]
        by = user_name(caller.uid)
        now = time.time()
        try:
            self.cordons.set(add=[Cordon(g.uuid, now, by, reason) for g in new])
        except OSError as exc:
            raise _fail(E.UNAVAILABLE, f"cannot record the drain in {self.cordons.path}: "
                        f"{exc.strerror or exc}; nothing was drained") from None  # fmt: skip
        for g in new:
            self._event("gpu_drained", f"GPU {g.index} ({g.uuid}) drained by {by}"
                        + (f": {reason}" if reason else ""))  # fmt: skip
            log.info("gpu_drained", gpu=g.uuid, by=by, reason=reason)
        return {"drained": [g.index for g in gpus], "newly": [g.index for g in new]}

    def undrain(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``undrain``: admit work again on one GPU or every drained one."""
        req = protocol.from_params(UndrainRequest, params)
        gpus = self._targets(caller, req.gpu, "undrain")
        index = {g.uuid: g.index for g in gpus}
        # Without --gpu: every drained GPU, also one that is no longer on the node.
        ended = sorted(self.cordons.drained() & set(index) if req.gpu else self.cordons.drained())
        try:
            self.cordons.set(remove=ended)
        except OSError as exc:
            raise _fail(E.UNAVAILABLE, f"cannot record the undrain in {self.cordons.path}: "
                        f"{exc.strerror or exc}; nothing changed") from None  # fmt: skip
        by = user_name(caller.uid)
        for uuid in ended:
            self._event("gpu_undrained", f"GPU {index.get(uuid, '?')} ({uuid}) admits work "
                        f"again ({by})")  # fmt: skip
            log.info("gpu_undrained", gpu=uuid, by=by)
        return {"undrained": [index.get(u, u) for u in ended]}

    def view(self, gpu_uuid: str) -> dict[str, Any] | None:
        """The ``drain`` entry of a GPU in ``status``: ``None`` when it is not drained."""
        c = self.cordons.get(gpu_uuid)
        if c is None:
            return None
        return {"since_wall_s": c.since_wall_s, "by": c.by_user, "reason": c.reason}
