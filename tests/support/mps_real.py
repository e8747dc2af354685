"""What the tests against the real MPS control binary share: GPU ids, sizes, event waits.

The fixtures that start supervisors are in ``tests/node/conftest.py``; these are the plain helpers
its modules (``tests/node/test_mps_supervisor.py``, ``..._commands.py``, ``..._setup.py``,
``..._node_manager.py``) call.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from gpushare.model import MpsEvent, MpsEventKind
from gpushare.node.mps import MpsSupervisor

GPU_A = "GPU-74d43ed3-1234-5678-9abc-bf5b4f46ed65"
GPU_B = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
GIB = 1 << 30
MIB = 1 << 20


def procs_using(pipe_root: Path) -> list[psutil.Process]:
    """Processes whose CUDA_MPS_PIPE_DIRECTORY lies under ``pipe_root``."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("CUDA_MPS_PIPE_DIRECTORY", "").startswith(str(pipe_root)):
            found.append(proc)
    return found


def events(s: MpsSupervisor) -> queue.Queue[MpsEvent]:
    """A queue that receives every event the supervisor emits from now on."""
    q: queue.Queue[MpsEvent] = queue.Queue()
    s.subscribe(q.put)
    return q


def wait_event(q: queue.Queue[MpsEvent], kind: MpsEventKind, timeout_s: float = 2.0) -> MpsEvent:
    """The next event of ``kind`` in ``q`` (others are dropped); fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {kind} event within {timeout_s}s")
        try:
            ev = q.get(timeout=left)
        except queue.Empty:
            continue
        if ev.kind is kind:
            return ev


def wait_until(pred: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``pred()`` held; fails after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if pred():
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"condition not met within {timeout_s}s")
