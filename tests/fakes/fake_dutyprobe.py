"""A fake GPU whose latency and memory follow what the daemon really does to its clients.

For the end-to-end control tests (``tests/daemon/test_e2e_control.py``), run inside a real daemon process
(``tests/support/daemon_proc.py`` with ``GPUSHARE_TEST_FAKE_GPU=duty``). The "GPU" is the daemon's own
child processes: a child whose environment names a GPU (``GPUSHARE_GPU_UUID``, as the launcher
sets it) is a client of that GPU.

* :class:`DutyProbe`: while the test's online burst is on (the file ``<state_dir>/burst`` exists),
  the probe's latency grows with the CPU time the GPU's clients actually consumed over the last
  ``window_s`` (``/proc/PID/schedstat``): a frozen client consumes none, so the latency responds
  to the duty cycle the daemon really applies, with the lag of the window (as queued kernels
  drain after a real freeze). Without the burst the latency stays at its baseline.
* :class:`DutyGpu`: each client uses the GPU memory its pinned limit says
  (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``), listed per process as NVML would; the rest of the GPU's
  use (the online side) is read from ``<state_dir>/mem_used`` (bytes), so a test can squeeze
  free memory under the reserve. ``<state_dir>/sm_active`` (a percentage), when present, is the
  GPU's SM activity, the online demand the controller measures while offline work is quiet.

Every probe reading is appended to ``<state_dir>/trace.jsonl`` for the test to inspect.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpushare.model import GpuSample, ProbeReading, ProcessMemory
from gpushare.units import parse_size
from tests.fakes.fake_gpu import GIB, FakeGpuBackend

_GPU_ENV = b"GPUSHARE_GPU_UUID="
_MEM_ENV = b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="


@dataclass(frozen=True, slots=True)
class Client:
    """One child process of this process that runs on a fake GPU."""

    pid: int
    gpu_uuid: str
    mem_bytes: int | None


def _children() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids.extend(int(p) for p in (task / "children").read_text().split())
    return pids


def clients() -> list[Client]:
    """This process's children that carry a GPU in their environment."""
    out: list[Client] = []
    for pid in _children():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        gpu = next((e[len(_GPU_ENV) :] for e in env if e.startswith(_GPU_ENV)), None)
        if gpu is None:
            continue
        mem = None
        limit = next((e[len(_MEM_ENV) :] for e in env if e.startswith(_MEM_ENV)), None)
        if limit is not None and b"=" in limit:
            with contextlib.suppress(ValueError):
                mem = parse_size(limit.split(b"=", 1)[1].decode())
        out.append(Client(pid, gpu.decode(), mem))
    return out


def cpu_ns(pid: int) -> int | None:
    """Time the process has spent on a CPU, in ns (``None`` once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class DutyProbe:
    """A LatencyProbe whose latency is ``baseline * (1 + gain * busy)`` during the burst.

    ``busy`` is the CPU time the GPU's clients consumed over the last ``window_s``, in CPUs.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        baseline_ms: float = 2.0,
        gain: float = 20.0,
        window_s: float = 0.25,
    ) -> None:
        self.state_dir = state_dir
        self.baseline_ms = baseline_ms
        self.gain = gain
        self.window_s = window_s
        self._history: dict[str, deque[tuple[float, dict[int, int]]]] = {}
        self._last: dict[str, tuple[float, ProbeReading]] = {}
        self.offline_running: dict[str, bool] = {}
        self.closed = False
        # The run loop and the API threads (status) both read it.
        self._lock = threading.Lock()

    def _busy(self, gpu_uuid: str, now: float) -> float:
        cpu = {
            c.pid: ns
            for c in clients()
            if c.gpu_uuid == gpu_uuid and (ns := cpu_ns(c.pid)) is not None
        }
        hist = self._history.setdefault(gpu_uuid, deque())
        hist.append((now, cpu))
        # Keep one sample at least window_s old: the window's start.
        while len(hist) > 2 and hist[1][0] <= now - self.window_s:
            hist.popleft()
        then, old = hist[0]
        if now - then <= 0:
            return 0.0
        used = sum(ns - old.get(pid, ns) for pid, ns in cpu.items())
        return max(0.0, used / 1e9 / (now - then))

    def reading(self, gpu_uuid: str) -> ProbeReading:
        """The latency over the window; readings closer than 20 ms apart share one measurement."""
        with self._lock:
            return self._reading(gpu_uuid)

    def _reading(self, gpu_uuid: str) -> ProbeReading:
        now = time.monotonic()
        last = self._last.get(gpu_uuid)
        if last is not None and now - last[0] < 0.02:
            return last[1]
        busy = self._busy(gpu_uuid, now)
        burst = (self.state_dir / "burst").exists()
        ratio = 1.0 + self.gain * busy if burst else 1.0
        latency = self.baseline_ms * ratio
        reading = ProbeReading(
            latency_ms=latency,
            run_ms=self.baseline_ms,
            baseline_ms=self.baseline_ms,
            ratio=ratio,
            samples=100,
        )
        self._last[gpu_uuid] = (now, reading)
        with open(self.state_dir / "trace.jsonl", "a") as f:
            f.write(json.dumps({"t": now, "gpu": gpu_uuid, "busy": busy, "ratio": ratio}) + "\n")
        return reading

    def set_offline_running(self, gpu_uuid: str, running: bool) -> None:
        self.offline_running[gpu_uuid] = running

    def close(self) -> None:
        self.closed = True


class DutyGpu(FakeGpuBackend):
    """FakeGpuBackend whose memory use is the clients' pinned limits plus ``<state_dir>/mem_used``."""

    def __init__(self, state_dir: Path, gpus: int = 1, mem_total_bytes: int = 16 * GIB) -> None:
        super().__init__(gpus=gpus, mem_total_bytes=mem_total_bytes, mem_used_bytes=1 * GIB)
        self.state_dir = state_dir

    def _base_used(self) -> int:
        try:
            return int((self.state_dir / "mem_used").read_text())
        except (OSError, ValueError):
            return self.mem_used_bytes

    def _sm_active(self) -> float | None:
        try:
            return float((self.state_dir / "sm_active").read_text())
        except (OSError, ValueError):
            return None

    def sample(self) -> Sequence[GpuSample]:
        base = self._base_used()
        sm_active = self._sm_active()
        running = clients()
        out = []
        for s in super().sample():
            mine = [c for c in running if c.gpu_uuid == s.uuid]
            used = base + sum(c.mem_bytes or 0 for c in mine)
            total = s.mem_total_bytes or 0
            out.append(
                GpuSample(
                    index=s.index,
                    uuid=s.uuid,
                    name=s.name,
                    sm_count=s.sm_count,
                    mem_total_bytes=total,
                    mem_used_bytes=used,
                    mem_free_bytes=max(0, total - used),
                    sm_active_pct=sm_active,
                    processes=tuple(ProcessMemory(c.pid, c.mem_bytes) for c in mine),
                )
            )
        return out
