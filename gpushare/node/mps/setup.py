"""What the MPS supervisor prepares around its control daemon: directories, environment, mode.

:class:`~gpushare.node.mps.supervisor.MpsSupervisor` calls these before every (re)start and at
stop: whether to run ``-multiuser-server``, the pipe and log directories (mode 0755), the stale
entries a dead daemon leaves in its pipe directory, the daemon's environment, and the GPU's
compute mode (``exclusive_process`` while gpushare runs MPS on it, restored at stop).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpushare.config import Config
from gpushare.node.base import ComputeModeControl
from gpushare.node.mps.commands import DAEMON_ENV_DROP, supports_multiuser
from gpushare.node.mps.errors import MpsSetupError

# Compute-mode names as node.base.ComputeModeControl spells them.
EXCLUSIVE_PROCESS = "exclusive_process"
# Entries the daemon leaves in its pipe directory (NVIDIA's MPS documentation, docs/sources.md).
PIPE_ENTRIES = (
    "control",
    "control_privileged",
    "control_lock",
    "log",
    "nvidia-cuda-mps-control.pid",
)


def decide_multiuser(config: Config) -> bool:
    """Whether to start the daemon with ``-multiuser-server`` (``mps.multiuser``).

    Raises:
        MpsSetupError: ``"on"`` where the binary lacks the option or gpushare is not root.
    """
    mode = config.mps.multiuser
    if mode == "off":
        return False
    supported = supports_multiuser(config.mps.control_binary)
    is_root = os.geteuid() == 0
    if mode == "on":
        if not supported:
            raise MpsSetupError(
                f'mps.multiuser = "on" but {config.mps.control_binary} has no '
                '-multiuser-server option (R535 lacks it); set mps.multiuser = "auto" or "off", '
                "or install a driver whose MPS has it (R555+)"
            )
        if not is_root:
            raise MpsSetupError(
                'mps.multiuser = "on" needs gpushare to run as root (only root may enable '
                '-multiuser-server); run as root or set mps.multiuser = "auto"'
            )
        return True
    return supported and is_root


def prepare_dirs(*dirs: Path) -> None:
    """Create the directories with mode 0755.

    Raises:
        MpsSetupError: one cannot be created or its mode set.
    """
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
            # Servers run under each client's uid and must traverse these (a 0700 directory
            # makes a setuid'd server crash-loop: bottlerocket-os/bottlerocket#4673).
            d.chmod(0o755)
        except OSError as exc:
            raise MpsSetupError(
                f"cannot create {d} with mode 0755: {exc.strerror or exc}; fix the permissions "
                "or set paths.mps_pipe_dir / paths.mps_log_dir"
            ) from exc


def remove_pipe_entries(pipe_dir: Path) -> None:
    """Remove the sockets and FIFO a daemon leaves in its pipe directory (gone ones are fine)."""
    for name in PIPE_ENTRIES:
        with contextlib.suppress(FileNotFoundError):
            (pipe_dir / name).unlink()


def daemon_env(
    *,
    gpu_uuid: str,
    pipe_dir: Path,
    log_dir: Path,
    control_binary: str,
    extra_path: Sequence[str],
) -> dict[str, str]:
    """The control daemon's environment: ours less what it must not inherit, its GPU and dirs."""
    env = {k: v for k, v in os.environ.items() if k not in DAEMON_ENV_DROP}
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe_dir)
    env["CUDA_MPS_LOG_DIRECTORY"] = str(log_dir)
    env["CUDA_VISIBLE_DEVICES"] = gpu_uuid
    env["LC_ALL"] = "C"
    path: list[str] = list(extra_path)
    binary = Path(control_binary)
    if binary.is_absolute():
        # A package unpacked elsewhere keeps the server in ../sbin next to bin/.
        path += [str(binary.parent), str(binary.parent.parent / "sbin")]
    path += [
        p
        for p in env.get(
            "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        ).split(":")
        if p
    ]
    env["PATH"] = ":".join(dict.fromkeys(path))
    return env


class ComputeModeGuard:
    """Sets the GPU to ``exclusive_process`` (``mps.compute_mode``) and restores what it found.

    Args:
        gpu_uuid: the GPU.
        control: NVML compute-mode access; ``None`` skips compute mode with a warning.
        log: the supervisor's logger, bound to the GPU.
    """

    def __init__(self, gpu_uuid: str, control: ComputeModeControl | None, log: Any) -> None:
        self._gpu_uuid = gpu_uuid
        self._compute = control
        self._log = log
        self._prev_mode: str | None = None

    def set(self, wanted: str) -> None:
        """Set ``exclusive_process`` when ``wanted`` is it; never raises (MPS works without)."""
        if wanted != "exclusive_process":
            return
        if self._compute is None:
            self._log.warning(
                "mps_compute_mode_skipped", reason="no NVML compute-mode access given"
            )
            return
        try:
            prev = self._compute.get_compute_mode(self._gpu_uuid)
            if prev != EXCLUSIVE_PROCESS:
                self._compute.set_compute_mode(self._gpu_uuid, EXCLUSIVE_PROCESS)
                self._prev_mode = prev
                self._log.info("mps_compute_mode_set", mode=EXCLUSIVE_PROCESS, previous=prev)
        # The adapter may raise anything NVML raises; MPS still works without the mode.
        except Exception as exc:  # noqa: BLE001
            self._log.warning("mps_compute_mode_failed", error=str(exc))

    def restore(self) -> None:
        """Put back the mode :meth:`set` changed, if it changed one; never raises."""
        prev, self._prev_mode = self._prev_mode, None
        if prev is None or self._compute is None:
            return
        try:
            self._compute.set_compute_mode(self._gpu_uuid, prev)
            self._log.info("mps_compute_mode_restored", mode=prev)
        except Exception as exc:  # noqa: BLE001 - as in set
            self._log.warning("mps_compute_mode_restore_failed", mode=prev, error=str(exc))
