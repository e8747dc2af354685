"""What ``gpushare env`` and the Slurm TaskProlog look up: the config, the GPU, the variables.

Kept apart from the Typer command so that a TaskProlog (``gpushare.slurm``, run before every task
of a job) does not pay for Typer's import.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpushare import config, mpsenv, paths, protocol
from gpushare.model import ClientClass

UNSET = ["CUDA_VISIBLE_DEVICES"]
"""What a workload must not inherit: the MPS server already maps its GPU to device 0."""

Gpu = tuple[int | None, str]
"""(index when known, UUID)."""


class GpuLookupError(Exception):
    """The GPU cannot be named; ``exit_code`` 2 for a bad ``--gpu``, 1 when the host cannot tell."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def load_config(path: Path | None) -> config.Config:
    """The config named, else the default file, else the built-in defaults when there is none.

    Raises:
        config.ConfigError: the file is unreadable or invalid (or named but missing).
    """
    target = path or paths.default_config_file()
    if path is None and not target.exists():
        return config.Config()
    return config.load(target)


def offline_priority(cfg: config.Config) -> int:
    """The ``CUDA_MPS_CLIENT_PRIORITY`` the configured policy gives offline clients."""
    from gpushare.control.registry import make_policy

    policy = make_policy(cfg.control.policy, cfg.control)
    return int(policy.offline_mps_priority)


def ask_daemon(socket: str | Path) -> dict[str, Any] | str:
    """The daemon's ``status``, or why it did not answer."""
    from gpushare.client import ApiClient, ApiError, DaemonUnreachableError

    try:
        with ApiClient.connect(socket, timeout_s=5.0, name="env") as api:
            status = api.call(protocol.STATUS)
    except (DaemonUnreachableError, ApiError, OSError) as exc:
        return f"the daemon at {socket} did not answer ({exc})"
    return status if isinstance(status, dict) else f"the daemon at {socket} gave no status"


def daemon_paths(status: dict[str, Any] | str) -> dict[str, str]:
    """The paths a daemon's status gives workloads (empty: an older daemon, or no answer)."""
    if isinstance(status, str):
        return {}
    found = (status.get("daemon") or {}).get("paths") or {}
    return {str(k): str(v) for k, v in found.items() if isinstance(v, str)}


def _daemon_gpus(answer: dict[str, Any] | str) -> list[Gpu] | str:
    if isinstance(answer, str):
        return answer
    return [(int(g["index"]), str(g["uuid"])) for g in answer.get("gpus", [])]


def _nvml_gpus() -> list[Gpu] | str:
    import logging
    import sys

    import structlog

    from gpushare.node import nvml
    from gpushare.node.nvml_errors import NvmlError

    # The adapter logs its failures; for `gpushare env` (stdout is the product) and a TaskProlog
    # the reason returned here is the message, said once.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )
    backend = nvml.NvmlBackend(events=False, init_timeout_s=10.0, call_timeout_s=5.0)
    try:
        return list(enumerate(backend.gpu_uuids()))
    except NvmlError as exc:
        return f"NVML cannot list the GPUs ({str(exc).partition('HINT:')[0].strip()})"
    finally:
        backend.close()


def daemon_socket(cfg: config.Config, socket: str | Path | None = None) -> str | Path:
    """The socket ``gpushare env`` asks: ``--socket``, ``$GPUSHARE_SOCKET``, the config's."""
    return socket or os.environ.get(paths.ENV_SOCKET) or cfg.paths.resolved("socket")


def gpu_sources(
    cfg: config.Config,
    socket: str | Path | None = None,
    answer: dict[str, Any] | str | None = None,
) -> list[Callable[[], list[Gpu] | str]]:
    """Where GPUs are looked up, in order: the running daemon's status, then NVML.

    ``answer`` is the daemon's status when the caller already asked (:func:`ask_daemon`).
    """
    sock = daemon_socket(cfg, socket)
    if answer is None:
        return [lambda: _daemon_gpus(ask_daemon(sock)), _nvml_gpus]
    return [lambda: _daemon_gpus(answer), _nvml_gpus]


def resolve_gpu(key: str | None, sources: Sequence[Callable[[], list[Gpu] | str]]) -> Gpu:
    """The GPU ``key`` names (an index or a UUID), or the only GPU when ``key`` is ``None``.

    Args:
        key: ``--gpu`` as given.
        sources: callables returning ``[(index, uuid), ...]`` or a reason they cannot; tried in
            order until one answers.

    Raises:
        GpuLookupError: no such GPU, several GPUs and no ``--gpu``, or nothing could list them.
    """
    if key is not None and (key.startswith(("GPU-", "MIG-"))):
        if not config.GPU_KEY_RE.match(key):
            raise GpuLookupError(f"--gpu {key!r} is not a GPU UUID (GPU-xxxxxxxx-...)", 2)
        return None, key
    if key is not None and not key.isdigit():
        raise GpuLookupError(f"--gpu takes an index (0, 1, ...) or a UUID, got {key!r}", 2)
    reasons: list[str] = []
    for source in sources:
        found = source()
        if isinstance(found, str):
            reasons.append(found)
            continue
        if key is None:
            if len(found) == 1:
                return found[0]
            listed = ", ".join(f"{i} ({u})" for i, u in found) or "none"
            raise GpuLookupError(f"{len(found)} GPUs here, give --gpu: {listed}", 2)
        match = [g for g in found if g[0] == int(key)]
        if not match:
            known = ", ".join(str(i) for i, _u in found) or "none"
            raise GpuLookupError(f"no GPU with index {key} (GPUs here: {known})", 2)
        return match[0]
    raise GpuLookupError(
        "cannot tell which GPU is meant: " + "; ".join(reasons)
        + ". Give --gpu with the GPU's UUID (nvidia-smi -L)",
        1,
    )  # fmt: skip


def workload_env(
    cfg: config.Config,
    cls: ClientClass,
    gpu_uuid: str,
    *,
    sm_pct: float | None,
    mem_bytes: int | None,
    slo_p99_s: float | None,
    daemon: Mapping[str, str] | None = None,
    token_slos_s: tuple[float | None, float | None] = (None, None),
) -> dict[str, str]:
    """The variables (MPS limits and markers) for one workload class on one GPU.

    ``daemon``: the paths the running daemon gave (:func:`daemon_paths`); each one it gives
    wins over the local config's, which may not be the one that daemon runs with.
    ``token_slos_s``: an LLM server's TTFT and TPOT SLOs, markers as the request SLO is.
    """
    given = daemon or {}
    sm = sm_pct if sm_pct is not None else mpsenv.default_sm_pct(
        cls, cfg.control.offline_sm_pct_default
    )  # fmt: skip
    limits = mpsenv.MpsLimits(
        gpu_uuid=gpu_uuid,
        sm_pct=sm,
        mem_bytes=mem_bytes,
        priority=mpsenv.priority(cls, offline_priority(cfg)),
    )
    env = mpsenv.mps_env(
        limits=limits,
        pipe_dir=mpsenv.pipe_dir(
            Path(given.get("mps_pipe_dir") or cfg.paths.resolved("mps_pipe_dir")), gpu_uuid
        ),
        latency_socket=Path(given.get("latency_socket") or cfg.paths.resolved("latency_socket")),
    )
    ttft, tpot = token_slos_s
    markers = mpsenv.marker_env(cls, slo_p99_s, slo_ttft_p99_s=ttft, slo_tpot_p99_s=tpot)
    return {**markers, **env}
