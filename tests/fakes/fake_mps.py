"""The fake :class:`gpushare.node.base.DaemonMpsNode` (an MpsNode the daemon holds) for every test.

It follows the documented MPS behaviour (MPS docs, docs/sources.md): a server starts for the first client of
a uid (``SERVER_STARTED`` then ``SERVER_READY``), clients connect (``CLIENT_CONNECTED``), a fatal
fault puts the GPU in FAULT (``FATAL_EXCEPTION``, every client affected), ``terminate_client``
succeeds only for a connected client, and recovery removes offline clients first, then the rest,
before the server is back. Event texts are the daemon's own messages.

Usage::

    node = FakeMpsNode(["GPU-a"])
    node.connect_client("GPU-a", pid=100, uid=1000)
    node.inject_fault("GPU-a")
    assert node.state("GPU-a") is MpsState.FAULT
    node.fail_next("terminate_client")          # next terminate_client returns False
    node.fail_next("state", RuntimeError("x"))  # next state() raises

Made without a GPU list (``FakeMpsNode(pipe_root=dir)``, the daemon's tests) the node is *open*:
every GPU has an MPS daemon, made on first use, and every pid counts as a connected client (those
tests run no CUDA client that could connect). Either way a file ``<pipe_root>/<uuid>.state``
naming an :class:`MpsState` value overrides the GPU's state, so that a test can set the state
of a daemon running in another process (``tests/support/daemon_proc.py``). Whatever the daemon
asks is recorded: :attr:`FakeMpsNode.terminated`, :attr:`FakeMpsNode.recovered`,
:attr:`FakeMpsNode.stopped`, and every call in :attr:`FakeMpsNode.calls`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpushare.model import MpsEvent, MpsEventKind, MpsState
from gpushare.node.base import MultiuserInfo
from gpushare.node.mps import DaemonNotReachable


@dataclass
class FakeGpu:
    """What the fake knows of one GPU's MPS daemon."""

    state: MpsState = MpsState.UP
    server_pid: int | None = None
    server_uid: int | None = None
    clients: dict[int, int] = field(default_factory=dict)  # client pid -> uid
    events: list[MpsEvent] = field(default_factory=list)


class FakeMpsNode:
    """In-memory MPS for ``gpu_uuids`` (every GPU when ``None``); records every call in :attr:`calls`."""

    backend = None
    supervisors: Mapping[str, MultiuserInfo] = {}

    def __init__(
        self,
        gpu_uuids: Iterable[str] | None = None,
        pipe_root: Path = Path("/tmp/fake-mps"),
        *,
        name: str = "mps",
        log: list[str] | None = None,
    ) -> None:
        """``log``: a list, shared by several fakes, where each call appends ``"<name>.<method>"``
        (the order in which a composite asked its parts)."""
        self.name = name
        self.log = log
        self.open = gpu_uuids is None
        self.gpus: dict[str, FakeGpu] = {u: FakeGpu() for u in gpu_uuids or ()}
        self.pipe_root = pipe_root
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.terminated: list[tuple[str, int]] = []
        self.recovered: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.stopped: list[bool] = []
        self.now_s = 0.0
        self._next_pid = 50_000
        self._failures: dict[str, BaseException | None] = {}

    # Scripting ------------------------------------------------------------------------------

    def fail_next(self, method: str, error: BaseException | None = None) -> None:
        """Make the next call of ``method`` fail.

        With no ``error``, ``terminate_client`` returns False and every other method raises
        :class:`DaemonNotReachable` with the front end's message.
        """
        self._failures[method] = error

    def set_state(self, gpu_uuid: str, state: MpsState) -> None:
        """Force the state ``state()`` reports."""
        self._gpu(gpu_uuid).state = state

    def push_event(
        self, gpu_uuid: str, kind: MpsEventKind, text: str = "", **fields: Any
    ) -> MpsEvent:
        """Queue an arbitrary event for ``drain_events``."""
        event = MpsEvent(kind, gpu_uuid, self.now_s, text, **fields)
        self._gpu(gpu_uuid).events.append(event)
        return event

    def connect_client(self, gpu_uuid: str, pid: int, uid: int = 1000) -> None:
        """A client connects; the first one of a uid starts the server (Legacy: one uid at a time)."""
        gpu = self._gpu(gpu_uuid)
        if gpu.state is MpsState.FAULT:
            raise RuntimeError("server in FAULT refuses new clients (CUDA error 807)")
        if gpu.server_pid is None:
            gpu.server_pid, gpu.server_uid = self._pid(), uid
            self.push_event(gpu_uuid, MpsEventKind.SERVER_STARTED,
                            f"Starting new server {gpu.server_pid} for user {uid}",
                            server_pid=gpu.server_pid, uid=uid)  # fmt: skip
            self.push_event(gpu_uuid, MpsEventKind.SERVER_READY,
                            f"NEW SERVER {gpu.server_pid}: Ready", server_pid=gpu.server_pid)  # fmt: skip
        elif gpu.server_uid != uid:
            raise RuntimeError(f"a server of uid {gpu.server_uid} runs: uid {uid} is queued by MPS")
        gpu.clients[pid] = uid
        self.push_event(gpu_uuid, MpsEventKind.CLIENT_CONNECTED,
                        f"NEW CLIENT {pid} from user {uid}: Server already exists",
                        client_pid=pid, uid=uid)  # fmt: skip

    def disconnect_client(self, gpu_uuid: str, pid: int) -> None:
        """A client exits on its own."""
        gpu = self._gpu(gpu_uuid)
        if gpu.clients.pop(pid, None) is not None:
            self.push_event(gpu_uuid, MpsEventKind.CLIENT_DISCONNECTED, f"client {pid} exited",
                            client_pid=pid)  # fmt: skip

    def inject_fault(self, gpu_uuid: str) -> None:
        """A client hits a fatal fault: the server goes to FAULT (every client of it is affected)."""
        gpu = self._gpu(gpu_uuid)
        gpu.state = MpsState.FAULT
        self.push_event(gpu_uuid, MpsEventKind.FATAL_EXCEPTION,
                        "Server encountered a fatal exception. Shutting down",
                        server_pid=gpu.server_pid)  # fmt: skip

    def kill_daemon(self, gpu_uuid: str) -> None:
        """The control daemon dies and the supervisor restarts it (servers and clients are lost)."""
        gpu = self._gpu(gpu_uuid)
        gpu.server_pid = gpu.server_uid = None
        gpu.clients.clear()
        gpu.state = MpsState.UP
        self.push_event(gpu_uuid, MpsEventKind.DAEMON_EXITED, "exited with status -9", status=-9)
        self.push_event(gpu_uuid, MpsEventKind.DAEMON_RESTARTED, "exited with status -9")

    def clients(self, gpu_uuid: str) -> dict[int, int]:
        """Connected client pids and their uids."""
        return dict(self._gpu(gpu_uuid).clients)

    # MpsNode --------------------------------------------------------------------------------

    def pipe_dir(self, gpu_uuid: str) -> Path:
        """``<pipe_root>/<uuid>``, as the real manager lays it out."""
        self._enter("pipe_dir", gpu_uuid)
        return self.pipe_root / gpu_uuid

    def state(self, gpu_uuid: str) -> MpsState:
        """The scripted state (``<pipe_root>/<uuid>.state`` when that file names one)."""
        self._enter("state", gpu_uuid)
        return self._state(gpu_uuid)

    def drain_events(self, gpu_uuid: str) -> Sequence[MpsEvent]:
        """Events since the last call."""
        self._enter("drain_events", gpu_uuid)
        gpu = self._gpu(gpu_uuid)
        out, gpu.events = gpu.events, []
        return out

    def terminate_client(self, gpu_uuid: str, client_pid: int) -> bool:
        """True and the client gone when it was connected; False otherwise (as MPS prints 1)."""
        self.terminated.append((gpu_uuid, client_pid))
        if self._enter("terminate_client", gpu_uuid, client_pid, soft=True):
            return False
        gpu = self._gpu(gpu_uuid)
        if client_pid not in gpu.clients:
            return self.open
        del gpu.clients[client_pid]
        return True

    def recover(
        self, gpu_uuid: str, offline_pids: Sequence[int], online_pids: Sequence[int]
    ) -> None:
        """Offline clients terminated first, then online, then the rest; the server is back ACTIVE."""
        self.recovered.append((gpu_uuid, tuple(offline_pids), tuple(online_pids)))
        self._enter("recover", gpu_uuid, tuple(offline_pids), tuple(online_pids))
        gpu = self._gpu(gpu_uuid)
        if self._state(gpu_uuid) is not MpsState.FAULT:
            self._step(gpu_uuid, "no_faulted_server: none in FAULT")
            return
        self._step(gpu_uuid, f"server_faulted: server {gpu.server_pid} in FAULT")
        order = [p for p in offline_pids if p in gpu.clients]
        order += [p for p in online_pids if p in gpu.clients and p not in order]
        order += sorted(set(gpu.clients) - set(order))
        for pid in order:
            del gpu.clients[pid]
            self._step(gpu_uuid, f"client_terminated: client {pid}", client_pid=pid)
        gpu.state = MpsState.UP
        self._step(gpu_uuid, f"server_active: server {gpu.server_pid} back to ACTIVE")

    def start(self) -> None:
        """Nothing to start."""
        self._enter("start")

    def stop(self, *, quit_daemon: bool = True) -> None:
        """Nothing to stop (recorded in :attr:`stopped`)."""
        self.stopped.append(quit_daemon)
        self._enter("stop", quit_daemon)

    # Internals ------------------------------------------------------------------------------

    def _gpu(self, gpu_uuid: str) -> FakeGpu:
        if self.open:
            return self.gpus.setdefault(gpu_uuid, FakeGpu())
        try:
            return self.gpus[gpu_uuid]
        except KeyError:
            raise KeyError(
                f"GPU {gpu_uuid} has no MPS daemon (shared GPUs: {', '.join(self.gpus)})"
            ) from None

    def _state(self, gpu_uuid: str) -> MpsState:
        gpu = self._gpu(gpu_uuid)
        try:
            return MpsState((self.pipe_root / f"{gpu_uuid}.state").read_text().strip())
        except (OSError, ValueError):
            return gpu.state

    def _pid(self) -> int:
        self._next_pid += 1
        return self._next_pid

    def _step(self, gpu_uuid: str, text: str, client_pid: int | None = None) -> None:
        self.push_event(gpu_uuid, MpsEventKind.RECOVERY_STEP, text,
                        server_pid=self._gpu(gpu_uuid).server_pid, client_pid=client_pid)  # fmt: skip

    def _enter(self, method: str, *args: Any, soft: bool = False) -> bool:
        self.calls.append((method, args))
        if self.log is not None:
            self.log.append(f"{self.name}.{method}")
        if method not in self._failures:
            return False
        error = self._failures.pop(method)
        if error is None and soft:
            return True
        raise error or DaemonNotReachable("Cannot find MPS control daemon process")
