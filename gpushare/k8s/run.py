"""Wiring for ``gpushare k8s device-plugin``: the config, the environment builder, the signals."""

from __future__ import annotations

import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from gpushare import config
from gpushare.control.pods import ENV_CLIENT_SCOPE, POD_SCOPE
from gpushare.k8s.devices import DaemonPaths, PluginSettings
from gpushare.k8s.plugin import DaemonGpus, DevicePlugin, EnvFor
from gpushare.model import ClientClass
from gpushare.roots.envresolve import workload_env


def env_builder(cfg: config.Config, settings: PluginSettings) -> EnvFor:
    """What a container of a class on a GPU with an SM share starts with.

    ``gpushare env``'s variables (the MPS pipe directory, share, priority, markers, latency
    socket), and ``CUDA_VISIBLE_DEVICES=0``: the device plugin API can set a variable but not
    unset one, and inside an MPS client its GPU is device 0 (what ``gpushare env`` unsets for);
    ``GPUSHARE_CLIENT_SCOPE=pod``: the daemon makes every container of the pod one client.
    """

    def env_for(
        cls: ClientClass, uuid: str, sm_pct: float, paths: DaemonPaths
    ) -> Mapping[str, str]:
        # The daemon's own paths (its status gives them), mounted into the container as they are.
        given = {"mps_pipe_dir": paths.mps_pipe_dir, "latency_socket": paths.latency_socket}
        slo = settings.online_slo_p99_s if cls is ClientClass.ONLINE else None
        env = workload_env(
            cfg, cls, uuid, sm_pct=sm_pct, mem_bytes=None, slo_p99_s=slo, daemon=given
        )
        # Every container of the pod is one client, frozen through the pod's cgroup.
        return {**env, "CUDA_VISIBLE_DEVICES": "0", ENV_CLIENT_SCOPE: POD_SCOPE}

    return env_for


def serve(
    cfg: config.Config,
    settings: PluginSettings,
    socket: str | Path,
    kubelet_dir: Path,
    poll_s: float,
) -> None:
    """Run the plugin until SIGTERM or SIGINT."""
    plugin = DevicePlugin(
        DaemonGpus(socket, cfg), env_builder(cfg, settings), settings, kubelet_dir, poll_s
    )

    def stop(_signum: int, _frame: FrameType | None) -> None:
        plugin.stop_event.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    plugin.run()
