"""What the device plugin advertises and what a container gets at Allocate; pure (no I/O, no gRPC).

Each shared GPU is advertised as replicas of two resources (``gpushare.io/online`` and
``gpushare.io/offline`` by default): device ids ``<GPU UUID>::<n>``. The kubelet hands a container
some of them; the container's class is its resource's, its GPU the one its ids name (all of them
must name one GPU: a container is the MPS client of one GPU's control daemon), and for offline
work its SM share is what it asked for, ``count * 100 / offline_replicas`` percent (with the
default 10 replicas, each unit of ``gpushare.io/offline`` is 10 % of the GPU's SMs), never more
than the node's policy for that GPU (``control.offline_sm_pct_max`` or its ``[gpus]`` entry's):
a pod author chooses only how many units to ask for, the scheduler counts them, and the node
caps what they are worth. Online work runs uncapped (:data:`gpushare.mpsenv.ONLINE_SM_PCT`):
gpushare protects it by throttling offline work, so an online unit only counts how many online
pods a GPU takes.

Why the request and not an annotation (docs/kubernetes.md, "Why the share is the request"):
the kubelet's Allocate names device ids only, no pod, and the pod's devices are known to the
kubelet's PodResources API only after Allocate has answered; an annotation is not counted by the
scheduler either, so pods could annotate more SMs than a GPU has.

What a container gets (:func:`allocation`): the environment ``gpushare env`` prints for its class,
GPU and share; its GPU's MPS pipe directory, the daemon's latency datagram socket and ``/dev/shm``
(the MPS server's shared memory) as mounts; its GPU as a CDI device and/or device nodes. Never the
API socket: :func:`check_mounts` refuses any mount that is the socket or a directory above it.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from gpushare import mpsenv
from gpushare.model import ClientClass

API_VERSION = "v1beta1"
"""The kubelet's device-plugin API version this plugin speaks."""
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
ID_SEP = "::"
MAX_ID_LEN = 63
"""The kubelet's limit on a device id."""


class AllocationError(ValueError):
    """The kubelet asked for devices that one container cannot be given (one line, the reason)."""


@dataclass(frozen=True, slots=True)
class PluginSettings:
    """How the plugin advertises GPUs and what it injects."""

    resource_prefix: str = "gpushare.io"
    online_replicas: int = 4
    """Online pods one GPU takes."""
    offline_replicas: int = 10
    """Units of ``<prefix>/offline`` per GPU; one unit is ``100 / offline_replicas`` % of its SMs."""
    online_slo_p99_s: float | None = None
    """The SLO online pods declare (``GPUSHARE_SLO_P99``); ``None``: none declared."""
    cdi_kind: str | None = "nvidia.com/gpu"
    """CDI devices named ``<kind>=<GPU UUID>`` (nvidia-ctk's names); ``None``: no CDI entry."""
    device_nodes: bool = False
    """Also pass ``/dev/nvidia<index>``, ``/dev/nvidiactl``, ``/dev/nvidia-uvm`` as device specs."""
    shm_dir: str = "/dev/shm"
    """The MPS server's shared memory, mounted at the same path; empty: not mounted."""

    def resource(self, cls: ClientClass) -> str:
        """The extended resource name of a class, e.g. ``gpushare.io/offline``."""
        return f"{self.resource_prefix}/{cls.value}"

    def replicas(self, cls: ClientClass) -> int:
        """How many devices of a class one GPU advertises."""
        return self.online_replicas if cls is ClientClass.ONLINE else self.offline_replicas


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU as the daemon reports it."""

    index: int
    uuid: str
    healthy: bool
    offline_sm_pct_max: float = 100.0
    """The node's policy: the most SMs an offline client of this GPU may start with (percent)."""


@dataclass(frozen=True, slots=True)
class DaemonPaths:
    """Where workloads reach the daemon: host paths, mounted into containers at the same path."""

    mps_pipe_dir: str
    latency_socket: str
    api_socket: str


@dataclass(frozen=True, slots=True)
class MountSpec:
    """A host path bind-mounted into a container at the same path."""

    host_path: str
    container_path: str
    read_only: bool


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node passed to a container (``permissions`` as the kubelet takes them: rwm)."""

    path: str
    permissions: str = "rw"


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one container is given."""

    gpu_uuid: str
    cls: ClientClass
    sm_pct: float
    """The share given: what was asked for, capped by the GPU's policy."""
    envs: Mapping[str, str]
    mounts: tuple[MountSpec, ...]
    cdi_devices: tuple[str, ...]
    device_nodes: tuple[DeviceNode, ...] = field(default=())
    asked_sm_pct: float | None = None
    """What the request was worth when the policy capped it; ``None``: not capped."""


def device_ids(gpus: Sequence[Gpu], replicas: int) -> list[tuple[str, bool]]:
    """Every device id of a resource with its health: ``replicas`` per GPU."""
    return [(f"{g.uuid}{ID_SEP}{n}", g.healthy) for g in gpus for n in range(replicas)]


def gpu_of(device_id: str) -> str:
    """The GPU UUID a device id names.

    Raises:
        AllocationError: not an id this plugin advertised.
    """
    uuid, sep, n = device_id.partition(ID_SEP)
    if not sep or not n.isdigit() or not uuid.startswith(("GPU-", "MIG-")):
        raise AllocationError(f"device id {device_id!r} is not one of gpushare's (<GPU UUID>::<n>)")
    return uuid


def preferred(available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """A preferred set of ``size`` ids, all on one GPU: the must-includes' GPU, else bin-packed.

    Bin-packing (the GPU with the fewest free ids that still has enough) keeps GPUs whole for
    large requests and puts the containers of one pod, which the kubelet admits one after the
    other, on the same GPU, where they are one client (an offline share spread over two GPUs
    cannot be one MPS client). Falls back to any ids when no single GPU has enough: the kubelet
    decides then, and Allocate says why it refuses.
    """
    chosen = list(dict.fromkeys(must_include))
    if len(chosen) >= size:
        return chosen[:size]
    by_gpu: dict[str, list[str]] = {}
    for dev in available:
        if dev not in chosen:
            by_gpu.setdefault(dev.partition(ID_SEP)[0], []).append(dev)
    wanted = {d.partition(ID_SEP)[0] for d in chosen}
    need = size - len(chosen)
    fits = [u for u in by_gpu if len(by_gpu[u]) >= need and (not wanted or wanted == {u})]
    if fits:
        best = min(fits, key=lambda u: (len(by_gpu[u]), u))
        return chosen + by_gpu[best][:need]
    rest = [d for u in sorted(by_gpu) for d in by_gpu[u]]
    return chosen + rest[:need]


def sm_share(
    cls: ClientClass, count: int, settings: PluginSettings, top_pct: float = 100.0
) -> float:
    """The SM percentage a container of ``cls`` holding ``count`` devices gets.

    ``top_pct``: the GPU's policy for offline work; an offline share never exceeds it.
    """
    if cls is ClientClass.ONLINE:
        return mpsenv.ONLINE_SM_PCT
    pct = count * 100.0 / settings.offline_replicas
    top = min(100.0, max(mpsenv.SM_PCT_MIN, top_pct))
    return float(min(top, max(mpsenv.SM_PCT_MIN, math.floor(pct * 100) / 100)))


def check_mounts(mounts: Sequence[MountSpec], api_socket: str) -> None:
    """Refuse a mount that would show a container the daemon's API socket.

    Raises:
        AllocationError: a mount is the socket itself or a directory that holds it.
    """
    sock = _norm(api_socket)
    for m in mounts:
        host = _norm(m.host_path)
        if host == sock or host in sock.parents:
            raise AllocationError(
                f"refusing to mount {m.host_path}: it holds the API socket {api_socket} (set "
                "paths.mps_pipe_dir and paths.latency_socket outside the socket's directory)"
            )


def _norm(path: str) -> PurePosixPath:
    # Lexical: "/run/x/..", "//run" and "/run/./gpushare" name the same directory to a mount.
    return PurePosixPath("/" + posixpath.normpath(path).lstrip("/"))


def allocation(
    cls: ClientClass,
    ids: Sequence[str],
    gpus: Sequence[Gpu],
    env_for: Callable[[ClientClass, str, float, DaemonPaths], Mapping[str, str]],
    paths: DaemonPaths | None,
    settings: PluginSettings,
) -> Allocation:
    """What a container holding ``ids`` of ``cls``'s resource is given.

    Args:
        cls: the resource's class.
        ids: the device ids the kubelet allocated to the container.
        gpus: the GPUs the daemon reports now.
        env_for: the environment for a class, GPU UUID, SM share and the daemon's paths
            (``gpushare env``'s).
        paths: the daemon's paths (``None``: it has not answered yet).
        settings: the plugin's settings.

    Raises:
        AllocationError: no ids, ids of several GPUs, of an unknown or unhealthy GPU, or a mount
            that would expose the API socket.
    """
    if not ids:
        raise AllocationError("the kubelet asked for no device")
    if paths is None:
        raise AllocationError("the daemon has not answered yet: its paths are unknown")
    uuids = sorted({gpu_of(d) for d in ids})
    if len(uuids) != 1:
        raise AllocationError(
            f"devices of {len(uuids)} GPUs ({', '.join(uuids)}) for one container: a container is "
            "the MPS client of one GPU"
        )
    uuid = uuids[0]
    gpu = next((g for g in gpus if g.uuid == uuid), None)
    if gpu is None or not gpu.healthy:
        why = "not shared by the daemon" if gpu is None else "unhealthy"
        raise AllocationError(f"GPU {uuid} is {why} now")
    pipe = str(mpsenv.pipe_dir(Path(paths.mps_pipe_dir), uuid))
    mounts = [
        MountSpec(pipe, pipe, read_only=False),
        MountSpec(paths.latency_socket, paths.latency_socket, read_only=False),
    ]
    if settings.shm_dir:
        mounts.append(MountSpec(settings.shm_dir, settings.shm_dir, read_only=False))
    check_mounts(mounts, paths.api_socket)
    nodes: tuple[DeviceNode, ...] = ()
    if settings.device_nodes:
        nodes = tuple(
            DeviceNode(p) for p in (f"/dev/nvidia{gpu.index}", "/dev/nvidiactl", "/dev/nvidia-uvm")
        )
    cdi = (f"{settings.cdi_kind}={uuid}",) if settings.cdi_kind else ()
    asked = sm_share(cls, len(ids), settings)
    sm = sm_share(cls, len(ids), settings, gpu.offline_sm_pct_max)
    return Allocation(
        gpu_uuid=uuid, cls=cls, sm_pct=sm, envs=dict(env_for(cls, uuid, sm, paths)),
        mounts=tuple(mounts), cdi_devices=cdi, device_nodes=nodes,
        asked_sm_pct=asked if asked != sm else None,
    )  # fmt: skip
