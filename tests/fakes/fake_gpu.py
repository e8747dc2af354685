"""The fake :class:`gpushare.node.base.GpuBackend`: GPUs as NVML would report them, set by the test.

Two ways to make one: ``FakeGpuBackend(gpus, mem_total_bytes, mem_used_bytes)`` reads identical
GPUs from its attributes on every :meth:`FakeGpuBackend.sample` (a test changes ``sm_busy`` or
``compute_mode`` between ticks), and ``FakeGpuBackend(samples=...)`` or
:meth:`FakeGpuBackend.uniform` returns fixed samples a test edits with :meth:`FakeGpuBackend.set`.
The real adapter against a fake pynvml is ``NvmlBackend(nvml=bench.support.fake_nvml.FakeNvmlLib(...))``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from bench.support.fake_nvml import uniform_samples
from gpushare.model import GpuEvent, GpuSample, SmPeriod

GIB = 1 << 30


def fake_uuid(index: int) -> str:
    return f"GPU-0000000{index}-1111-2222-3333-44444444444{index}"


class FakeGpuBackend:
    """``gpus`` identical GPUs of ``mem_total_bytes`` with ``mem_used_bytes`` in use, or ``samples``.

    ``sm_busy``: ``None``, the driver has no per-process utilisation; else the pids it lists as
    using the SMs in one sampling period per :meth:`sample`, ending then (as NVML does, no period
    when it lists nobody). ``compute_mode`` is what NVML reads for every GPU. Both apply to the
    GPUs made from the attributes; fixed ``samples`` are returned as they are.
    """

    simulated = False

    def __init__(
        self,
        gpus: int = 2,
        mem_total_bytes: int = 16 * GIB,
        mem_used_bytes: int = 1 * GIB,
        *,
        samples: Sequence[GpuSample] | None = None,
    ) -> None:
        self.gpus = gpus if samples is None else len(samples)
        self.mem_total_bytes = mem_total_bytes
        self.mem_used_bytes = mem_used_bytes
        self.samples = None if samples is None else list(samples)
        self.events: list[GpuEvent] = []
        self.closed = False
        self.sm_busy: set[int] | None = None
        self.compute_mode: str | None = None
        self.sample_calls = 0

    @classmethod
    def uniform(cls, gpus: int, clients_per_gpu: int, *, first_pid: int = 10_000) -> FakeGpuBackend:
        """``gpus`` healthy GPUs, each with an MPS client process per client (1 GiB each)."""
        return cls(samples=uniform_samples(gpus, clients_per_gpu, first_pid=first_pid))

    def set(self, index: int, **changes: Any) -> None:
        """Change fields of one fixed sample."""
        assert self.samples is not None, "set() edits fixed samples: make the fake with samples="
        self.samples[index] = replace(self.samples[index], **changes)

    def sample(self) -> Sequence[GpuSample]:
        self.sample_calls += 1
        if self.samples is not None:
            return tuple(self.samples)
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
