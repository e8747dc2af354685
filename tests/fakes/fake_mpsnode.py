"""A small fake MpsNode for daemon tests: pipe directories, a settable state, recorded commands."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from gpushare.model import MpsEvent, MpsState
from gpushare.node.base import MultiuserInfo


class FakeMpsNode:
    """Every GPU's MPS is UP unless ``<root>/<uuid>.state`` names another MpsState value."""

    backend = None
    supervisors: Mapping[str, MultiuserInfo] = {}

    def __init__(self, root: Path) -> None:
        self.root = root
        self.terminated: list[tuple[str, int]] = []
        self.recovered: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.stopped: list[bool] = []

    def pipe_dir(self, gpu_uuid: str) -> Path:
        return self.root / gpu_uuid

    def state(self, gpu_uuid: str) -> MpsState:
        override = self.root / f"{gpu_uuid}.state"
        try:
            return MpsState(override.read_text().strip())
        except (OSError, ValueError):
            return MpsState.UP

    def drain_events(self, gpu_uuid: str) -> Sequence[MpsEvent]:
        return []

    def terminate_client(self, gpu_uuid: str, client_pid: int) -> bool:
        self.terminated.append((gpu_uuid, client_pid))
        return True

    def recover(
        self, gpu_uuid: str, offline_pids: Sequence[int], online_pids: Sequence[int]
    ) -> None:
        self.recovered.append((gpu_uuid, tuple(offline_pids), tuple(online_pids)))

    def start(self) -> None:
        pass

    def stop(self, *, quit_daemon: bool = True) -> None:
        self.stopped.append(quit_daemon)
