"""The environment a workload must start with so that MPS applies gpushare's limits to it.

MPS reads a client's SM share, pinned-memory cap and priority from its environment once, when the
client connects (NVIDIA's MPS documentation, docs/sources.md), so a workload gpushare did not launch (a systemd
service, a container, a Slurm task) gets its limits only if it is started with these variables.
``gpushare env`` prints them (:func:`render`); the daemon computes the same ones when it launches a
client. Everything here is pure: no I/O, no clock.

Variables (NVIDIA's names first, then gpushare's own):

=====================================  ============================================================
``CUDA_MPS_PIPE_DIRECTORY``            the GPU's MPS control daemon: ``<paths.mps_pipe_dir>/<uuid>``
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``  SM share, (0, 100], written ``50`` not ``50.0``
``CUDA_MPS_CLIENT_PRIORITY``           ``0`` normal (online), ``1`` below normal (offline, policy)
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``   ``<GPU UUID>=<int>G|M``, only with a memory limit
``GPUSHARE_CLASS``                     ``online`` or ``offline``: the marker adoption rules read
``GPUSHARE_SLO_P99``                   the online p99 SLO, e.g. ``40ms`` (online only, optional)
``GPUSHARE_GPU_UUID``                  the GPU the limits are for
``GPUSHARE_LATENCY_SOCKET``            where :func:`gpushare.client.report_latency` sends
=====================================  ============================================================

``CUDA_VISIBLE_DEVICES`` must not be set in a client: the GPU's MPS server runs with
``CUDA_VISIBLE_DEVICES=<uuid>`` and the client sees that GPU as device 0 (:data:`UNSET_ENV`).
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpushare import paths
from gpushare.model import ClientClass
from gpushare.units import format_duration, format_mps_size

ENV_CLASS = "GPUSHARE_CLASS"
ENV_SLO_P99 = "GPUSHARE_SLO_P99"
#: An LLM server's token SLOs (``--slo-ttft-p99``, ``--slo-tpot-p99``), markers like ENV_SLO_P99.
ENV_SLO_TTFT_P99 = "GPUSHARE_SLO_TTFT_P99"
ENV_SLO_TPOT_P99 = "GPUSHARE_SLO_TPOT_P99"
#: The longest token SLO taken: a longer one is a typo (an hour to the first token protects nothing).
MAX_SLO_S = 3600.0
ENV_GPU_UUID = "GPUSHARE_GPU_UUID"

ONLINE_SM_PCT = 100.0
"""Online clients run uncapped: their share is protected by throttling offline work instead."""

MIN_MEM_BYTES = 1 << 20
"""The smallest pinned-memory cap MPS can express (``1M``)."""

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

Format = Literal["shell", "systemd", "docker", "slurm"]
FORMATS: tuple[Format, ...] = ("shell", "systemd", "docker", "slurm")


@dataclass(frozen=True, slots=True)
class MpsLimits:
    """What MPS is told about one client at start."""

    gpu_uuid: str
    sm_pct: float
    mem_bytes: int | None
    priority: int


SM_PCT_MIN = 1.0
"""The smallest SM share gpushare hands to MPS. MPS takes (0, 100] and rounds a share down to its
hardware granularity (one SM's part of the GPU, 100/N % for N SMs), so a share far under one SM
(5e-324, shown as 0 %) would give a client one SM or none. Every GPU gpushare targets has at most
a few hundred SMs; 1 % is also ``control.offline_sm_pct_min``'s floor."""


def sm_pct_problem(sm_pct: float) -> str | None:
    """Why ``sm_pct`` is no SM share (one line), or None: finite, within [1, 100]."""
    if not (math.isfinite(sm_pct) and 0 < sm_pct <= 100):
        shown = f"{sm_pct:g}" if math.isfinite(sm_pct) else str(sm_pct)
        return f"--sm must be a percentage in (0, 100], got {shown}"
    if sm_pct < SM_PCT_MIN:
        return (
            f"--sm must be at least {SM_PCT_MIN:g} (MPS rounds a share down to whole SMs), "
            f"got {sm_pct:g}"
        )
    return None


def check_limits(
    cls: ClientClass, sm_pct: float | None, mem_bytes: int | None, slo_p99_s: float | None
) -> None:
    """Refuse limits MPS or the controller cannot use; the message names the option and the fix.

    Raises:
        ValueError: an SM share outside (0, 100], a memory cap under 1M, or an SLO that is not a
            positive duration or is given for an offline client.
    """
    if sm_pct is not None and (problem := sm_pct_problem(sm_pct)) is not None:
        raise ValueError(problem)
    if mem_bytes is not None and mem_bytes < MIN_MEM_BYTES:
        raise ValueError("--mem must be at least 1M (MPS counts pinned memory in MiB)")
    if slo_p99_s is not None:
        if cls is not ClientClass.ONLINE:
            raise ValueError("--slo-p99 applies to --online workloads only")
        if not (math.isfinite(slo_p99_s) and slo_p99_s > 0):
            raise ValueError("--slo-p99 must be a positive duration such as 40ms")


def slo_problem(flag: str, cls: ClientClass, seconds: float) -> str | None:
    """Why an SLO (``--slo-ttft-p99``, ``--slo-tpot-p99``) cannot be used, or ``None``."""
    if cls is not ClientClass.ONLINE:
        return f"{flag} applies to --online clients only"
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_SLO_S):
        return f"{flag} must be a positive duration of at most 1h, such as 500ms"
    return None


def priority(cls: ClientClass, offline_priority: int) -> int:
    """``CUDA_MPS_CLIENT_PRIORITY`` of a class: online 0; offline what the policy says.

    Args:
        cls: the client's class.
        offline_priority: the policy's ``offline_mps_priority`` (baselines compare without it).
    """
    return 0 if cls is ClientClass.ONLINE else offline_priority


def default_sm_pct(cls: ClientClass, offline_share_pct: float) -> float:
    """The SM share a client gets when none was asked for.

    Args:
        cls: the client's class.
        offline_share_pct: the offline share in force on the GPU (the controller's, or
            ``control.offline_sm_pct_default`` before it has set one).
    """
    return ONLINE_SM_PCT if cls is ClientClass.ONLINE else offline_share_pct


def pipe_dir(mps_pipe_root: Path, gpu_uuid: str) -> Path:
    """The ``CUDA_MPS_PIPE_DIRECTORY`` of a GPU's control daemon: ``<paths.mps_pipe_dir>/<uuid>``."""
    return mps_pipe_root / gpu_uuid


def format_pct(value: float) -> str:
    """An SM percentage as MPS reads it: ``50`` rather than ``50.0``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def mps_env(
    *,
    limits: MpsLimits,
    pipe_dir: Path,
    latency_socket: Path,
    client_id: str | None = None,
) -> dict[str, str]:
    """The variables a workload runs with on its GPU (NVIDIA's names, plus gpushare's own).

    Args:
        limits: GPU, SM share, memory cap and priority.
        pipe_dir: the GPU's MPS pipe directory (:func:`pipe_dir`).
        latency_socket: the daemon's latency socket, for ``report_latency``.
        client_id: the client's id when the daemon launches it; ``None`` for a workload started
            elsewhere (the daemon names it when it adopts the process).
    """
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": format_pct(limits.sm_pct),
        "CUDA_MPS_CLIENT_PRIORITY": str(limits.priority),
        ENV_GPU_UUID: limits.gpu_uuid,
        paths.ENV_LATENCY_SOCKET: str(latency_socket),
    }
    if client_id is not None:
        env[paths.ENV_CLIENT_ID] = client_id
    if limits.mem_bytes is not None:
        # Keyed by UUID: the device ordinal inside the client is 0, the UUID is unambiguous.
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = (
            f"{limits.gpu_uuid}={format_mps_size(limits.mem_bytes)}"
        )
    return env


ENV_GANG = "GPUSHARE_GANG"
"""A gang's per-rank environments (JSON, one object per rank), read by ``gpushare rank-exec``."""
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_GANG_LOCAL_RANK = "GPUSHARE_LOCAL_RANK"
"""Where ``rank-exec`` keeps the launcher's ``LOCAL_RANK``: the worker sees ``LOCAL_RANK=0``,
since its one GPU is device 0 under its MPS server."""


class RankError(ValueError):
    """``rank-exec`` cannot give this process a rank's GPU; the message is one line for the user."""


def gang_env(ranks: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The variable that carries every rank's GPU environment to ``gpushare rank-exec``."""
    return {ENV_GANG: json.dumps([dict(r) for r in ranks], separators=(",", ":"))}


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of the rank named by ``LOCAL_RANK``: its GPU's variables over ``environ``.

    Raises:
        RankError: no gang, no or a bad ``LOCAL_RANK``, or a rank outside the gang.
    """
    raw = environ.get(ENV_GANG)
    if raw is None:
        raise RankError(
            f"{ENV_GANG} is not set: run rank-exec under `gpushare submit --gpus N -- torchrun ...`"
        )
    try:
        ranks = json.loads(raw)
        ok = isinstance(ranks, list) and all(
            isinstance(r, dict) and all(isinstance(v, str) for v in r.values()) for r in ranks
        )
    except ValueError:
        ok = False
    if not ok or not ranks:
        raise RankError(f"{ENV_GANG} is not a gang's environment (set by gpushare submit --gpus)")
    text = environ.get(ENV_LOCAL_RANK)
    if text is None:
        raise RankError(f"{ENV_LOCAL_RANK} is not set: rank-exec runs as a worker of torchrun")
    if not text.isdigit() or int(text) >= len(ranks):
        raise RankError(
            f"{ENV_LOCAL_RANK}={text!r} is not a rank of this gang (0 to {len(ranks) - 1})"
        )
    env = {k: v for k, v in environ.items() if k not in UNSET_ENV}
    env.update(ranks[int(text)])
    env[ENV_GANG_LOCAL_RANK] = text
    env[ENV_LOCAL_RANK] = "0"
    return env


def marker_env(
    cls: ClientClass,
    slo_p99_s: float | None,
    *,
    slo_ttft_p99_s: float | None = None,
    slo_tpot_p99_s: float | None = None,
) -> dict[str, str]:
    """The markers an adoption rule reads back from ``/proc/<pid>/environ``."""
    env = {ENV_CLASS: cls.value}
    for name, slo_s in (
        (ENV_SLO_P99, slo_p99_s),
        (ENV_SLO_TTFT_P99, slo_ttft_p99_s),
        (ENV_SLO_TPOT_P99, slo_tpot_p99_s),
    ):
        if slo_s is not None:
            env[name] = format_duration(slo_s)
    return env


def workload_env(caller_env: Mapping[str, str], mps: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment minus :data:`UNSET_ENV`, plus the MPS variables.

    An ``LD_PRELOAD`` of gpushare's (a bounded shallow queue) goes in front of the caller's own,
    which keeps working: the dynamic loader takes a ``:``- or blank-separated list.
    """
    env = {k: v for k, v in caller_env.items() if k not in UNSET_ENV}
    theirs = env.get("LD_PRELOAD", "").strip()
    env.update(mps)
    if "LD_PRELOAD" in mps and theirs:
        env["LD_PRELOAD"] = f"{mps['LD_PRELOAD']}:{theirs}"
    return env


def render(
    env: Mapping[str, str], fmt: Format, unset: Sequence[str] = ("CUDA_VISIBLE_DEVICES",)
) -> str:
    """``env`` as text a workload can be started with.

    Args:
        env: the variables to set.
        fmt: ``shell`` (``export`` lines for ``eval``/``source``), ``systemd`` (a drop-in with
            ``Environment=`` lines), ``docker`` (an ``--env-file``), ``slurm`` (what a
            ``TaskProlog`` prints: ``export NAME=value`` taken literally, no quoting).
        unset: variables the workload must not inherit; ``docker`` cannot unset, so it says so
            in a comment.

    Raises:
        ValueError: a value the format cannot carry (a newline anywhere; in ``slurm`` and
            ``docker`` also leading or trailing blanks, which they would not keep).
    """
    for name, value in env.items():
        if "\n" in value or "\0" in value:
            raise ValueError(f"{name}: a value with a newline cannot be written as {fmt}")
        if fmt in ("slurm", "docker") and value != value.strip():
            raise ValueError(f"{name}: {fmt} would drop the blanks around {value!r}")
    lines: list[str]
    if fmt == "shell":
        lines = [f"unset {name}" for name in unset]
        lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    elif fmt == "slurm":
        lines = [f"unset {name}" for name in unset]
        lines += [f"export {name}={value}" for name, value in env.items()]
    elif fmt == "systemd":
        lines = ["[Service]"]
        lines += [f"UnsetEnvironment={name}" for name in unset]
        lines += [f"Environment={_systemd_quote(f'{name}={value}')}" for name, value in env.items()]
    else:
        lines = [f"# do not set {name} in the container" for name in unset]
        lines += [f"{name}={value}" for name, value in env.items()]
    return "\n".join(lines) + "\n"


def _systemd_quote(assignment: str) -> str:
    # systemd.syntax(7): double quotes, with backslash, quote, and the specifier % escaped.
    escaped = assignment.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'"{escaped}"'
