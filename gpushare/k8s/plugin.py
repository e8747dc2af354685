"""The kubelet device plugin: one gRPC server per resource, registered with the kubelet.

The only module that speaks gRPC to the kubelet. For each class (online, offline) it serves the
``v1beta1.DevicePlugin`` service on ``<kubelet dir>/gpushare-<class>.sock`` and registers it on the
kubelet's ``kubelet.sock`` (``v1beta1.Registration``). It follows the daemon's GPUs every
``poll_s`` (:class:`DaemonGpus`): a GPU whose MPS is not up, or every GPU while the daemon does
not answer, is sent ``Unhealthy`` on ``ListAndWatch``, so that the kubelet stops placing pods on
it. A restarted kubelet removes every plugin socket and recreates its own: when either is seen
(:class:`KubeletWatch`), the servers are started again and registered again.

What a container gets is :mod:`gpushare.k8s.devices`'; the environment is ``gpushare env``'s
(:func:`gpushare.roots.envresolve.workload_env`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import grpc
import structlog

from gpushare import config, protocol
from gpushare.k8s import devices
from gpushare.k8s.devices import AllocationError, DaemonPaths, Gpu, PluginSettings
from gpushare.k8s.proto import api_pb2 as pb
from gpushare.k8s.proto import api_pb2_grpc as pb_grpc
from gpushare.model import ClientClass, MpsState

log = structlog.get_logger(__name__)

KUBELET_SOCKET = "kubelet.sock"
DEFAULT_KUBELET_DIR = Path("/var/lib/kubelet/device-plugins")


class GpuSource(Protocol):
    """Where the plugin learns the GPUs and the daemon's paths."""

    def poll(self) -> tuple[list[Gpu], DaemonPaths] | str:
        """The GPUs and paths now, or why they cannot be known (one line)."""
        ...


class DaemonGpus:
    """The running daemon's ``status``: its shared GPUs, their MPS state and its paths.

    Each GPU's offline cap is the config's (:meth:`gpushare.config.Config.for_gpu`): the plugin
    reads the daemon's own file (the DaemonSet mounts one ConfigMap into both containers).
    """

    def __init__(self, socket: str | Path, cfg: config.Config) -> None:
        self.socket = str(socket)
        self.cfg = cfg

    def poll(self) -> tuple[list[Gpu], DaemonPaths] | str:
        """Ask the daemon once (5 s timeout)."""
        from gpushare.client import ApiClient, ApiError, DaemonUnreachableError

        try:
            with ApiClient.connect(self.socket, timeout_s=5.0, name="k8s-device-plugin") as api:
                status = api.call(protocol.STATUS)
        except (DaemonUnreachableError, ApiError, OSError) as exc:
            return f"the daemon at {self.socket} did not answer ({exc})"
        if not isinstance(status, dict):
            return f"the daemon at {self.socket} gave no status"
        given = (status.get("daemon") or {}).get("paths") or {}
        paths = DaemonPaths(
            mps_pipe_dir=str(given.get("mps_pipe_dir") or self.cfg.paths.resolved("mps_pipe_dir")),
            latency_socket=str(
                given.get("latency_socket") or self.cfg.paths.resolved("latency_socket")
            ),
            api_socket=self.socket,
        )
        gpus = []
        for g in status.get("gpus", []):
            if not g.get("shared"):
                continue
            index, uuid = int(g["index"]), str(g["uuid"])
            top = self.cfg.for_gpu(index, uuid).offline_sm_pct_max
            gpus.append(Gpu(index, uuid, g.get("mps_state") == MpsState.UP.value, top))
        return gpus, paths


class NodeState:
    """The GPUs last seen, shared by every server's ``ListAndWatch`` streams."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._gpus: list[Gpu] = []
        self._paths: DaemonPaths | None = None
        self.version = 0
        self.stopped = False

    def set(self, gpus: list[Gpu], paths: DaemonPaths | None) -> bool:
        """Record what the daemon says; True when it changed (streams are woken)."""
        with self._cond:
            if gpus == self._gpus and (paths is None or paths == self._paths):
                return False
            self._gpus = gpus
            self._paths = paths or self._paths
            self.version += 1
            self._cond.notify_all()
            return True

    def snapshot(self) -> tuple[list[Gpu], DaemonPaths | None, int]:
        """GPUs, paths and the version they are."""
        with self._cond:
            return list(self._gpus), self._paths, self.version

    def wait_change(self, seen: int, timeout_s: float) -> int:
        """Block until the version differs from ``seen`` (or the timeout, or a stop)."""
        with self._cond:
            self._cond.wait_for(lambda: self.version != seen or self.stopped, timeout_s)
            return self.version

    def stop(self) -> None:
        """End every stream."""
        with self._cond:
            self.stopped = True
            self._cond.notify_all()


EnvFor = Callable[[ClientClass, str, float, DaemonPaths], Mapping[str, str]]


class Servicer(pb_grpc.DevicePluginServicer):
    """``v1beta1.DevicePlugin`` for one class's resource."""

    def __init__(
        self, cls: ClientClass, settings: PluginSettings, state: NodeState, env_for: EnvFor
    ) -> None:
        self.cls = cls
        self.settings = settings
        self.state = state
        self.env_for = env_for

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Options: GetPreferredAllocation is implemented; no PreStartContainer."""
        return pb.DevicePluginOptions(get_preferred_allocation_available=True)

    def _devices(self) -> Any:
        gpus, _paths, _v = self.state.snapshot()
        ids = devices.device_ids(gpus, self.settings.replicas(self.cls))
        return pb.ListAndWatchResponse(
            devices=[
                pb.Device(ID=i, health=devices.HEALTHY if ok else devices.UNHEALTHY)
                for i, ok in ids
            ]
        )

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        """The devices now, then again on every change, until the kubelet or the plugin ends."""
        _g, _p, seen = self.state.snapshot()
        yield self._devices()
        while context.is_active() and not self.state.stopped:
            now = self.state.wait_change(seen, 1.0)
            if now != seen and not self.state.stopped:
                seen = now
                yield self._devices()

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Ids packed onto one GPU per container (:func:`gpushare.k8s.devices.preferred`)."""
        return pb.PreferredAllocationResponse(
            container_responses=[
                pb.ContainerPreferredAllocationResponse(
                    deviceIDs=devices.preferred(
                        list(r.available_deviceIDs),
                        list(r.must_include_deviceIDs),
                        int(r.allocation_size),
                    )  # fmt: skip
                )
                for r in request.container_requests
            ]
        )

    def Allocate(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Environment, mounts and devices per container; refuses (INVALID_ARGUMENT) with why."""
        gpus, paths, _v = self.state.snapshot()
        out = []
        try:
            for r in request.container_requests:
                a = devices.allocation(
                    self.cls, list(r.devices_ids), gpus, self.env_for, paths, self.settings
                )
                if a.asked_sm_pct is not None:
                    log.warning(
                        "share_capped", resource=self.settings.resource(self.cls),
                        gpu=a.gpu_uuid, asked_sm_pct=a.asked_sm_pct, sm_pct=a.sm_pct,
                    )  # fmt: skip
                out.append(_response(a))
        except AllocationError as exc:
            log.warning(
                "allocate_refused", resource=self.settings.resource(self.cls), error=str(exc)
            )
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info(
            "allocated", resource=self.settings.resource(self.cls),
            devices=[list(r.devices_ids) for r in request.container_requests],
        )  # fmt: skip
        return pb.AllocateResponse(container_responses=out)

    def PreStartContainer(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Not asked for (``pre_start_required`` is false): nothing to do."""
        return pb.PreStartContainerResponse()


def _response(a: devices.Allocation) -> Any:
    return pb.ContainerAllocateResponse(
        envs=dict(a.envs),
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in a.mounts
        ],
        devices=[
            pb.DeviceSpec(container_path=d.path, host_path=d.path, permissions=d.permissions)
            for d in a.device_nodes
        ],
        cdi_devices=[pb.CDIDevice(name=n) for n in a.cdi_devices],
    )


@dataclass(frozen=True, slots=True)
class KubeletWatch:
    """What tells a restarted kubelet: its socket's inode changed, or a plugin socket vanished."""

    kubelet_ino: int | None
    ours: tuple[Path, ...]

    @classmethod
    def now(cls, kubelet_dir: Path, ours: Sequence[Path]) -> KubeletWatch:
        """The watch as things are now."""
        return cls(_inode(kubelet_dir / KUBELET_SOCKET), tuple(ours))

    def restarted(self, kubelet_dir: Path) -> str | None:
        """Why the servers must be registered again, or ``None``."""
        ino = _inode(kubelet_dir / KUBELET_SOCKET)
        if ino is None:
            return None  # the kubelet is down: wait for its socket to come back
        if ino != self.kubelet_ino:
            return "the kubelet's socket was recreated"
        gone = [p.name for p in self.ours if _inode(p) is None]
        return f"the plugin socket {gone[0]} was removed" if gone else None


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


class DevicePlugin:
    """Serves every class's resource and keeps it registered while :meth:`run` runs."""

    def __init__(
        self,
        source: GpuSource,
        env_for: EnvFor,
        settings: PluginSettings,
        kubelet_dir: Path = DEFAULT_KUBELET_DIR,
        poll_s: float = 5.0,
    ) -> None:
        self.source = source
        self.settings = settings
        self.kubelet_dir = kubelet_dir
        self.poll_s = poll_s
        self.state = NodeState()
        self.servicers = {c: Servicer(c, settings, self.state, env_for) for c in ClientClass}
        self._servers: list[grpc.Server] = []
        self.stop_event = threading.Event()
        self.registrations = 0
        self._last_error: str | None = None

    def socket_of(self, cls: ClientClass) -> Path:
        """The plugin socket of a class."""
        return self.kubelet_dir / f"gpushare-{cls.value}.sock"

    def refresh(self) -> None:
        """Ask the source once; every GPU unhealthy while it does not answer."""
        found = self.source.poll()
        if isinstance(found, str):
            gpus, _paths, _v = self.state.snapshot()
            if self.state.set([replace(g, healthy=False) for g in gpus], None):
                log.warning("daemon_unreachable", error=found)
            return
        if self.state.set(*found):
            log.info("gpus", gpus=[(g.uuid, g.healthy) for g in found[0]])

    def serve_and_register(self) -> None:
        """(Re)start every server on a fresh socket and register it with the kubelet.

        Raises:
            grpc.RpcError: the kubelet refused or did not answer a registration.
        """
        self._stop_servers()
        for cls, servicer in self.servicers.items():
            sock = self.socket_of(cls)
            sock.unlink(missing_ok=True)
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
            pb_grpc.add_DevicePluginServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
            server.add_insecure_port(f"unix://{sock}")
            server.start()
            self._servers.append(server)
        for cls in self.servicers:
            self._register(cls)
        self.registrations += 1

    def _register(self, cls: ClientClass) -> None:
        with grpc.insecure_channel(f"unix://{self.kubelet_dir / KUBELET_SOCKET}") as channel:
            pb_grpc.RegistrationStub(channel).Register(  # type: ignore[no-untyped-call]
                pb.RegisterRequest(
                    version=devices.API_VERSION,
                    endpoint=self.socket_of(cls).name,
                    resource_name=self.settings.resource(cls),
                    options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
                ),
                timeout=10.0,
            )
        log.info("registered", resource=self.settings.resource(cls))

    def run(self) -> None:
        """Serve until :attr:`stop_event`: poll the daemon, re-register after a kubelet restart."""
        self.refresh()
        polled = time.monotonic()
        watch: KubeletWatch | None = None
        while not self.stop_event.is_set():
            watch = self._ensure_registered(watch)
            # The kubelet's socket is looked at every second (a stat), the daemon every poll_s.
            self.stop_event.wait(min(self.poll_s, 1.0))
            if time.monotonic() - polled >= self.poll_s:
                self.refresh()
                polled = time.monotonic()
        self.close()

    def _ensure_registered(self, watch: KubeletWatch | None) -> KubeletWatch | None:
        """Serve and register when first started or after a kubelet restart; the new watch."""
        why = "first start" if watch is None else watch.restarted(self.kubelet_dir)
        if why is None or not (self.kubelet_dir / KUBELET_SOCKET).exists():
            return watch  # nothing changed, or no kubelet to register with yet
        try:
            self.serve_and_register()
        except grpc.RpcError as exc:
            error = f"{exc.code()}: {exc.details()}"
            if error != self._last_error:  # once per distinct failure, not every second
                log.warning("register_failed", why=why, error=error)
                self._last_error = error
            return watch
        self._last_error = None
        log.info("serving", why=why)
        return KubeletWatch.now(self.kubelet_dir, [self.socket_of(c) for c in ClientClass])

    def close(self) -> None:
        """Stop every stream and server and remove the sockets."""
        self.state.stop()
        self._stop_servers()

    def _stop_servers(self) -> None:
        for server in self._servers:
            server.stop(grace=0.5).wait(2.0)
        self._servers.clear()
        for cls in ClientClass:
            self.socket_of(cls).unlink(missing_ok=True)
