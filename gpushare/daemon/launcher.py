"""How a client's queue is set before it starts: the queue mode, its environment, the preload library.

MPS fixes a client's SM share, pinned-memory cap and priority when the client starts
(docs/design.md §2), so everything is decided before exec, by the same code that ``gpushare env``
prints from (:mod:`gpushare.mpsenv`). The process itself is started by the real process host,
:mod:`gpushare.node.procs.host`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from gpushare import native
from gpushare.config import GateConfig
from gpushare.model import queue_mode
from gpushare.native import CONTROL_ENV, INFLIGHT_ENV, LIBRARY_NAME

BLOCKING_ENV = {"CUDA_LAUNCH_BLOCKING": "1"}
"""A shallow queue by ``[gate] shallow_queue = "blocking"``: every kernel launch returns only when
the kernel has finished (CUDA Programming Guide, "Asynchronous Concurrent Execution"), so the
client has at most one kernel on the GPU and a freeze bites within one kernel. The guide documents
the variable as a debugging aid; its price is the CPU's time per kernel, which no longer overlaps
the GPU's (docs/controller.md, "Shallow offline queues")."""

SHALLOW_MARKERS = ("CUDA_LAUNCH_BLOCKING", INFLIGHT_ENV, CONTROL_ENV)
"""The variables that say, in a running client's environment, that it was launched shallow."""


def shallow_how(env: Mapping[str, str]) -> str | None:
    """How a client launched with ``env`` keeps its queue shallow, ``None`` for a deep queue.

    ``"<k> in flight"`` (the in-flight bound) or ``"blocking"`` (``CUDA_LAUNCH_BLOCKING=1``). Read
    from the launch environment and, on re-adoption, from ``/proc/<pid>/environ``.
    """
    if INFLIGHT_ENV in env:
        return f"{env[INFLIGHT_ENV]} in flight"
    if env.get("CUDA_LAUNCH_BLOCKING") == "1":
        return "blocking"
    return None


def choose_queue(mode: str | None, *, gating_on: bool) -> tuple[str, str]:
    """The queue an offline client is launched with: ``("shallow" | "deep", why)``.

    ``shallow`` and ``deep`` are what the submitter asked; ``None`` is
    :data:`gpushare.model.DEFAULT_QUEUE_MODE`. ``auto`` is decided at every (re)launch: shallow while request
    gating is on for the client's GPU (a freeze must bite within a kernel for gating to protect a
    request), deep otherwise. Deep even with the cheap in-flight bound: without gating, the duty
    cycle's freezes are what throttle, and a deep queue running on past each of them is offline
    work the duty cycle's loop has learned to allow (tried on the simulator: auto always bounded
    gave 0.07 of solo instead of 0.12 without gating over the 39 scenarios at 1.1x, attainment
    the same).
    MPS and CUDA read the variable at start, so a running client changes mode only when it is
    relaunched: a restart for a new share, a requeue, or the controller's restart of a restartable
    auto client whose queue does not match gating (``gpushare.control.restarts.shallow_restart``
    1 s after gating turns on, ``queue_restart`` a ``share_min_interval`` after it turns off).
    """
    effective = queue_mode(mode)
    how = f"--queue {mode}" if mode is not None else f"default queue ({effective})"
    if effective == "shallow":
        return "shallow", how
    if effective == "auto":
        if gating_on:
            return "shallow", f"{how}: request gating is on for this GPU"
        return "deep", f"{how}: request gating is off for this GPU"
    return "deep", how


def queue_env(
    queue: str,
    gate: GateConfig,
    library: str | None,
    *,
    vet: Callable[[str], str | None] | None = None,
) -> tuple[dict[str, str], str]:
    """The variables of an effective queue mode (:func:`choose_queue`), and how it is kept shallow.

    ``library`` is the built in-flight bound (:func:`gpushare.native.library_path`), ``None`` when
    clients could not preload it at daemon start (:func:`gpushare.native.unusable_reason`).
    ``vet`` (the daemon passes :func:`library_refusal`) asks again now, at this launch: a library
    that was root's at start may have been replaced since by a user who can write a directory
    above it, and it would run in this client with its submitter's rights (root's, too). In both
    cases ``[gate] shallow_queue = "bounded"`` falls back to ``CUDA_LAUNCH_BLOCKING`` (a freeze
    still bites within a kernel; only the throughput is lower) and says why.
    The preload is joined in front of the workload's own ``LD_PRELOAD`` by
    :func:`gpushare.mpsenv.workload_env`.
    """
    if queue != "shallow":
        return {}, "deep"
    if gate.shallow_queue == "bounded":
        refused = None if library is None or vet is None else vet(library)
        if library is not None and refused is None:
            k = gate.inflight_kernels
            env = {"LD_PRELOAD": library, INFLIGHT_ENV: str(k)}
            return env, f"at most {k} kernels in flight ({LIBRARY_NAME})"
        return dict(BLOCKING_ENV), f"CUDA_LAUNCH_BLOCKING=1: {refused or CANNOT_PRELOAD}"
    return dict(BLOCKING_ENV), "CUDA_LAUNCH_BLOCKING=1"


def vetted_library(library: str | None, vet: Callable[[str], str | None] | None) -> str | None:
    """``library`` when it may be preloaded at this launch (``vet`` asked now), else ``None``."""
    if library is None or (vet is not None and vet(library) is not None):
        return None
    return library


def library_refusal(library: str) -> str | None:
    """Why ``library`` may not be preloaded at this launch (:func:`gpushare.native.unusable_reason`).

    A refusal is counted (``status``: ``trust_refusals``) and logged once per state of the files.
    """
    return native.unusable_reason(Path(library))


CANNOT_PRELOAD = (
    f"{LIBRARY_NAME} cannot be preloaded here (`gpushare doctor` says why; "
    "`sudo gpushare install` builds it)"
)
"""Why a bounded shallow queue runs as a blocking one, in each launch's ``offline_queue`` line."""

FALLBACK = '[gate] shallow_queue = "bounded" falls back to CUDA_LAUNCH_BLOCKING=1'
"""What happens then (the daemon's start-up warning names the reason)."""
