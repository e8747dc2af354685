"""A fake GpuBackend: one or two GPUs with fixed memory, as NVML would report them."""

from __future__ import annotations

import time
from collections.abc import Sequence

from gpushare.model import GpuEvent, GpuSample, SmPeriod

GIB = 1 << 30


def fake_uuid(index: int) -> str:
    return f"GPU-0000000{index}-1111-2222-3333-44444444444{index}"


class FakeGpuBackend:
    """``gpus`` identical GPUs of ``mem_total_bytes`` with ``mem_used_bytes`` in use.

    ``sm_busy``: ``None``, the driver has no per-process utilisation; else the pids it lists as
    using the SMs in one sampling period per :meth:`sample`, ending then (as NVML does, no period
    when it lists nobody). ``compute_mode`` is what NVML reads for every GPU.
    """

    simulated = False

    def __init__(
        self, gpus: int = 2, mem_total_bytes: int = 16 * GIB, mem_used_bytes: int = 1 * GIB
    ) -> None:
        self.gpus = gpus
        self.mem_total_bytes = mem_total_bytes
        self.mem_used_bytes = mem_used_bytes
        self.events: list[GpuEvent] = []
        self.closed = False
        self.sm_busy: set[int] | None = None
        self.compute_mode: str | None = None

    def sample(self) -> Sequence[GpuSample]:
        busy = self.sm_busy
        periods = None
        if busy is not None:
            periods = (SmPeriod(time.time(), tuple(sorted(busy))),) if busy else ()
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
                sm_periods=periods,
                compute_mode=self.compute_mode,
            )
            for i in range(self.gpus)
        ]

    def drain_events(self) -> Sequence[GpuEvent]:
        out, self.events = self.events, []
        return out

    def close(self) -> None:
        self.closed = True
