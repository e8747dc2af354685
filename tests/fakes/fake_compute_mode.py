"""The fake :class:`gpushare.node.base.ComputeModeControl`: a GPU's compute mode, and who set it."""

from __future__ import annotations


class FakeComputeMode:
    """Reads ``mode`` (every GPU alike) and records each ``(gpu_uuid, mode)`` set in ``calls``."""

    def __init__(self, mode: str | None = "default") -> None:
        self.mode = mode
        self.calls: list[tuple[str, str]] = []

    def get_compute_mode(self, uuid: str) -> str | None:
        return self.mode

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        self.calls.append((uuid, mode))
        self.mode = mode
