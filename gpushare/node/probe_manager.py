"""The parent side of the latency probe: one worker process per GPU, supervised, read as a p99.

:class:`ProbeManager` implements :class:`gpushare.node.base.LatencyProbe`: it starts the worker of
:mod:`gpushare.node.probe` (``python -m gpushare.node.probe``, the only module that imports
cuda-python) as an MPS client of each GPU, restarts it with backoff, reads its JSON lines into a
:class:`~gpushare.node.probe_window.ProbeWindow` and reports the window's p99 and its ratio to the
baseline. Without a driver every reading says ``"unavailable: <why>"`` and nothing else breaks.

**Each probe worker occupies one MPS client slot on its GPU** (mps.md: contexts count against the
client limit), reported by :meth:`ProbeManager.mps_client_slots` and :meth:`ProbeManager.status`.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from gpushare.config import ProbeConfig
from gpushare.model import ProbeReading
from gpushare.node.probe import EXIT_ERROR, EXIT_UNAVAILABLE
from gpushare.node.probe_window import ProbeWindow

if TYPE_CHECKING:
    from gpushare.node.base import SlotHoldingProbe

log = structlog.get_logger(__name__)

# A worker that ran at least this long before failing restarts at the minimum backoff again.
HEALTHY_RUN_S = 60.0


@dataclass(frozen=True, slots=True)
class ProbeStatus:
    """What ``gpushare status`` shows about one GPU's probe."""

    gpu_uuid: str
    state: str
    mps_client_slots: int
    pid: int | None = None
    bindings: str | None = None
    compute_capability: str | None = None
    mps_enabled: bool | None = None
    restarts: int = 0
    last_error: str | None = None


class _GpuProbe:
    """Supervision state of one GPU's worker (guarded by the manager's lock)."""

    def __init__(self, uuid: str, env: Mapping[str, str], window: ProbeWindow) -> None:
        self.uuid = uuid
        self.env = dict(env)
        self.window = window
        self.state = "starting"
        self.proc: subprocess.Popen[bytes] | None = None
        self.thread: threading.Thread | None = None
        self.bindings: str | None = None
        self.compute_capability: str | None = None
        self.mps_enabled: bool | None = None
        self.restarts = 0
        self.last_error: str | None = None
        self.unavailable: str | None = None
        self.stop = threading.Event()


class ProbeManager:
    """Runs one probe worker per GPU and turns their samples into :class:`ProbeReading` values.

    Args:
        config: the ``[probe]`` section.
        worker_argv: the command of a worker for a GPU (default: this module under the daemon's
            Python); tests substitute a worker with a fake driver.
        clock: monotonic clock (sample times, window, stall detection).
    """

    def __init__(
        self,
        config: ProbeConfig,
        *,
        worker_argv: Callable[[str], Sequence[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._worker_argv = worker_argv or self._default_argv
        self._clock = clock
        self._lock = threading.Lock()
        self._gpus: dict[str, _GpuProbe] = {}
        self._closed = False

    def _default_argv(self, gpu_uuid: str) -> list[str]:
        c = self.config
        return [
            sys.executable,
            "-m",
            "gpushare.node.probe",
            "--gpu",
            gpu_uuid,
            "--period-s",
            repr(c.period_s),
            "--cycles",
            str(c.kernel_spin_cycles),
            "--watch-stdin",
        ]

    def start(self, gpu_uuid: str, env: Mapping[str, str]) -> None:
        """Start (and keep restarting) the probe worker of a GPU.

        Args:
            gpu_uuid: the GPU.
            env: the worker's whole environment, with ``CUDA_MPS_PIPE_DIRECTORY`` and
                ``CUDA_MPS_LOG_DIRECTORY`` of that GPU's MPS daemon, so it runs as an MPS client.
                ``CUDA_VISIBLE_DEVICES`` defaults to the UUID and ``CUDA_MPS_CLIENT_PRIORITY`` to 0
                (the probe measures what a normal-priority online client sees).
        """
        c = self.config
        full_env = dict(env)
        full_env.setdefault("CUDA_VISIBLE_DEVICES", gpu_uuid)
        full_env.setdefault("CUDA_MPS_CLIENT_PRIORITY", "0")
        with self._lock:
            if self._closed:
                raise RuntimeError("the probe manager is closed")
            if gpu_uuid in self._gpus:
                return
            probe = _GpuProbe(
                gpu_uuid, full_env, ProbeWindow(c.window_s, c.baseline_window_s, c.period_s)
            )
            self._gpus[gpu_uuid] = probe
            if not c.enabled:
                probe.state = "disabled"
                return
            probe.thread = threading.Thread(
                target=self._supervise, args=(probe,), name=f"probe-{gpu_uuid[:12]}", daemon=True
            )
            probe.thread.start()

    def _supervise(self, probe: _GpuProbe) -> None:
        c = self.config
        backoff = c.restart_backoff_min_s
        while not probe.stop.is_set():
            started = self._clock()
            code = self._run_once(probe)
            if probe.stop.is_set():
                break
            ran_s = self._clock() - started
            if ran_s >= HEALTHY_RUN_S:
                backoff = c.restart_backoff_min_s
            if code == EXIT_UNAVAILABLE:
                # A missing driver does not come back by itself soon; try rarely.
                wait_s = c.restart_backoff_max_s
            else:
                wait_s = backoff
                backoff = min(backoff * 2, c.restart_backoff_max_s)
            with self._lock:
                probe.state = "unavailable" if code == EXIT_UNAVAILABLE else "restarting"
                probe.restarts += 1
            log.warning(
                "probe_restart_scheduled",
                gpu=probe.uuid,
                exit_code=code,
                wait_s=wait_s,
                error=probe.last_error,
            )
            probe.stop.wait(wait_s)

    def _run_once(self, probe: _GpuProbe) -> int:
        argv = list(self._worker_argv(probe.uuid))
        try:
            # A long-lived child that streams JSON lines: exec.run (bounded one-shot commands)
            # does not fit, so this is the one Popen of the probe.
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=probe.env,
            )
        except OSError as exc:
            with self._lock:
                probe.last_error = f"cannot start the probe worker: {exc}"
            return EXIT_ERROR
        with self._lock:
            probe.proc = proc
            probe.state = "starting"
        log.info("probe_started", gpu=probe.uuid, pid=proc.pid)
        assert proc.stdout is not None
        for raw in proc.stdout:
            self._on_line(probe, raw)
        code = proc.wait()
        proc.stdout.close()
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        with self._lock:
            probe.proc = None
            probe.window.clear()
        return code

    def _on_line(self, probe: _GpuProbe, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
            kind = msg["type"]
        except (ValueError, KeyError, TypeError):
            log.debug(
                "probe_worker_output", gpu=probe.uuid, line=raw[:200].decode(errors="replace")
            )
            return
        now = self._clock()
        with self._lock:
            if kind == "sample":
                probe.state = "running"
                probe.window.add(now, float(msg["latency_ms"]), float(msg["run_ms"]))
            elif kind == "hello":
                probe.bindings = f"{msg.get('bindings')} {msg.get('bindings_version')}"
            elif kind == "ready":
                probe.compute_capability = msg.get("compute_capability")
                probe.mps_enabled = msg.get("mps_enabled")
                probe.unavailable = None
                probe.state = "running"
            elif kind == "unavailable":
                probe.unavailable = str(msg.get("reason"))
                probe.last_error = probe.unavailable
                probe.state = "unavailable"
            elif kind == "error":
                probe.last_error = str(msg.get("message"))
        if kind == "ready":
            log.info("probe_ready", gpu=probe.uuid, **{k: v for k, v in msg.items() if k != "type"})
            if msg.get("mps_enabled") is False:
                log.warning(
                    "probe_not_under_mps",
                    gpu=probe.uuid,
                    hint="check CUDA_MPS_PIPE_DIRECTORY: the probe bypassed MPS",
                )
        elif kind in ("unavailable", "error"):
            log.warning("probe_worker_failed", gpu=probe.uuid, kind=kind, error=probe.last_error)

    def reading(self, gpu_uuid: str) -> ProbeReading:
        """The probe's p99 over its window on one GPU; never raises."""
        with self._lock:
            probe = self._gpus.get(gpu_uuid)
            if probe is None:
                return ProbeReading(reason="unavailable: no probe started on this GPU")
            if probe.state == "disabled":
                return ProbeReading(reason="unavailable: probe disabled in config")
            if probe.unavailable is not None:
                return ProbeReading(reason=f"unavailable: {probe.unavailable}")
            if probe.state == "restarting":
                why = f"probe restarting after: {probe.last_error}"
                return ProbeReading(baseline_ms=probe.window.baseline_ms, reason=why)
            return probe.window.reading(self._clock())

    def set_offline_running(self, gpu_uuid: str, running: bool) -> None:
        """Tell the probe whether offline work runs on a GPU (the baseline is learned without)."""
        with self._lock:
            probe = self._gpus.get(gpu_uuid)
            if probe is not None:
                probe.window.offline_running = running

    def mps_client_slots(self, gpu_uuid: str) -> int:
        """MPS client slots the probe occupies on a GPU: 1 while its worker runs, else 0."""
        with self._lock:
            probe = self._gpus.get(gpu_uuid)
            return _slots(probe) if probe is not None else 0

    def status(self, gpu_uuid: str) -> ProbeStatus:
        """The probe's state on a GPU, for ``gpushare status`` (says it holds an MPS slot)."""
        with self._lock:
            probe = self._gpus.get(gpu_uuid)
            if probe is None:
                return ProbeStatus(gpu_uuid=gpu_uuid, state="not_started", mps_client_slots=0)
            return ProbeStatus(
                gpu_uuid=gpu_uuid,
                state=probe.state,
                mps_client_slots=_slots(probe),
                pid=probe.proc.pid if probe.proc is not None else None,
                bindings=probe.bindings,
                compute_capability=probe.compute_capability,
                mps_enabled=probe.mps_enabled,
                restarts=probe.restarts,
                last_error=probe.last_error,
            )

    def stop(self, gpu_uuid: str, timeout_s: float = 5.0) -> None:
        """Stop one GPU's worker (SIGTERM, then SIGKILL after ``timeout_s``)."""
        with self._lock:
            probe = self._gpus.pop(gpu_uuid, None)
        if probe is not None:
            self._stop_probe(probe, timeout_s)

    def _stop_probe(self, probe: _GpuProbe, timeout_s: float) -> None:
        probe.stop.set()
        with self._lock:
            proc = probe.proc
        if proc is not None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if probe.thread is not None:
            probe.thread.join(timeout=timeout_s)

    def close(self) -> None:
        """Stop every probe worker."""
        with self._lock:
            self._closed = True
            probes = list(self._gpus.values())
            self._gpus.clear()
        for probe in probes:
            self._stop_probe(probe, 5.0)


def _slots(probe: _GpuProbe) -> int:
    # A live worker holds (or is opening) one MPS client context; one without a driver does not.
    return 1 if probe.proc is not None and probe.unavailable is None else 0


if TYPE_CHECKING:  # ProbeManager is what the daemon holds as its LatencyProbe

    def _conforms(m: ProbeManager) -> SlotHoldingProbe:
        return m
