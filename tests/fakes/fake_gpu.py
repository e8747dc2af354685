"""A fake GpuBackend: one or two GPUs with fixed memory, as NVML would report them."""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.model import GpuEvent, GpuSample

GIB = 1 << 30


def fake_uuid(index: int) -> str:
    return f"GPU-0000000{index}-1111-2222-3333-44444444444{index}"


class FakeGpuBackend:
    """``gpus`` identical GPUs of ``mem_total_bytes`` with ``mem_used_bytes`` in use."""

    def __init__(
        self, gpus: int = 2, mem_total_bytes: int = 16 * GIB, mem_used_bytes: int = 1 * GIB
    ) -> None:
        self.gpus = gpus
        self.mem_total_bytes = mem_total_bytes
        self.mem_used_bytes = mem_used_bytes
        self.events: list[GpuEvent] = []
        self.closed = False

    def sample(self) -> Sequence[GpuSample]:
        return [
            GpuSample(
                index=i,
                uuid=fake_uuid(i),
                name="Fake H100",
                sm_count=132,
                mem_total_bytes=self.mem_total_bytes,
                mem_used_bytes=self.mem_used_bytes,
                mem_free_bytes=self.mem_total_bytes - self.mem_used_bytes,
                gpu_util_pct=None,
            )
            for i in range(self.gpus)
        ]

    def drain_events(self) -> Sequence[GpuEvent]:
        out, self.events = self.events, []
        return out

    def close(self) -> None:
        self.closed = True
