"""Starting clients: the MPS environment a workload gets, and detached spawning as its submitter.

MPS fixes a client's SM share, pinned-memory cap and priority when the client starts (docs/design.md §2),
so everything is decided here, before exec. The workload always runs as the submitting user with
that user's groups (docs/design.md D9); argv is a list end to end, never a shell string.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpushare import paths
from gpushare.node import procs
from gpushare.units import format_mps_size

UNSET_ENV: tuple[str, ...] = (
    # The MPS server of a GPU is started with CUDA_VISIBLE_DEVICES=<uuid> and the client sees
    # that GPU as device 0; an index the user had set would point at a device that is not there.
    "CUDA_VISIBLE_DEVICES",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_CLIENT_PRIORITY",
    "CUDA_MPS_DEVICE_MEM_LIMIT",
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
)
"""Variables removed from a workload's environment before the MPS variables are added."""

ENV_GPU_UUID = "GPUSHARE_GPU_UUID"


@dataclass(frozen=True, slots=True)
class LaunchLimits:
    """What MPS is told about one client at start."""

    gpu_uuid: str
    sm_pct: float
    mem_bytes: int | None
    priority: int


def format_pct(value: float) -> str:
    """An SM percentage as MPS reads it: ``50`` rather than ``50.0``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def mps_env(
    *,
    client_id: str,
    limits: LaunchLimits,
    pipe_dir: Path,
    latency_socket: Path,
) -> dict[str, str]:
    """The variables a workload runs with on its GPU (NVIDIA's names, plus gpushare's own)."""
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": format_pct(limits.sm_pct),
        "CUDA_MPS_CLIENT_PRIORITY": str(limits.priority),
        ENV_GPU_UUID: limits.gpu_uuid,
        paths.ENV_CLIENT_ID: client_id,
        paths.ENV_LATENCY_SOCKET: str(latency_socket),
    }
    if limits.mem_bytes is not None:
        # Keyed by UUID: the device ordinal inside the client is 0, the UUID is unambiguous.
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = (
            f"{limits.gpu_uuid}={format_mps_size(limits.mem_bytes)}"
        )
    return env


SHALLOW_ENV = {"CUDA_LAUNCH_BLOCKING": "1"}
"""What a shallow-queue offline client runs with: every kernel launch returns only when the kernel
has finished (CUDA Programming Guide, "Asynchronous Concurrent Execution"), so the client has at
most one kernel on the GPU, and a freeze bites within one kernel instead of after its queue has
drained. The guide documents the variable as a debugging aid; its effect is exactly a one-kernel
queue, at the price of a launch gap per kernel (docs/controller.md, "Shallow offline queues")."""


def choose_queue(mode: str | None, *, gating_on: bool) -> tuple[str, str]:
    """The queue an offline client is launched with: ``("shallow" | "deep", why)``.

    ``shallow`` and ``deep`` are what the submitter asked; ``None`` is ``deep`` (the behaviour
    before queues could be chosen). ``auto`` is decided at every (re)launch: shallow while request
    gating is on for the client's GPU (a freeze must bite within a kernel for gating to protect a
    request), deep otherwise (nothing freezes per request, so the launch gap would buy nothing).
    MPS and CUDA read the variable at start, so a running client changes mode only when it is
    relaunched: a restart for a new share, a requeue, or the controller's restart of a restartable
    auto client once gating has settled (``GpushareController._queue_restart``).
    """
    if mode == "shallow":
        return "shallow", "--queue shallow"
    if mode == "auto":
        if gating_on:
            return "shallow", "--queue auto: request gating is on for this GPU"
        return "deep", "--queue auto: request gating is off for this GPU"
    return "deep", "--queue deep" if mode == "deep" else "default queue (deep)"


def queue_env(queue: str) -> dict[str, str]:
    """The variables of an effective queue mode (:func:`choose_queue`)."""
    return dict(SHALLOW_ENV) if queue == "shallow" else {}


def workload_env(caller_env: Mapping[str, str], mps: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment minus :data:`UNSET_ENV`, plus the MPS variables."""
    env = {k: v for k, v in caller_env.items() if k not in UNSET_ENV}
    env.update(mps)
    return env


def spawn_detached(
    argv: Sequence[str],
    *,
    uid: int,
    gid: int,
    cwd: str,
    env: Mapping[str, str],
    log_dir: Path,
    client_id: str,
    cgroup_procs_fd: int | None = None,
) -> tuple[subprocess.Popen[bytes], float | None, Path]:
    """Start a detached workload as ``uid`` with its login groups; (process, start time, log).

    Raises:
        OSError: the program, the working directory or the log cannot be used.
    """
    log_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    log_path = log_dir / f"{client_id}.log"
    proc = procs.spawn(
        argv,
        uid=uid,
        gid=gid,
        groups=procs.user_groups(uid, gid),
        cwd=cwd,
        env=env,
        log_path=log_path,
        cgroup_procs_fd=cgroup_procs_fd,
    )
    return proc, procs.process_start_time(proc.pid), log_path
