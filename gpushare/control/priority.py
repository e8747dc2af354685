"""Offline priority per GPU: the MPS priority a GPU's offline clients are launched with.

MPS fixes a client's priority when it connects (``CUDA_MPS_CLIENT_PRIORITY``: 0 normal, 1 below
normal), so like the SM share it is a launch setting (``[control] offline_mps_priority``, 1 by
default: offline kernels wait for online ones). Next to an LLM server that always has a batch in
flight, that leaves offline work only the server's gaps: on the model, at load 50 % and an SLO of
1.5x the p99s alone, offline work launched at 1 got 0.12 of its solo throughput, and at 0 (the
server's own priority) 0.43, with every request inside the SLO; at 1.1x, 0 let 1-1.5 % of requests
over where 1 kept them all inside (docs/benchmarks.md, "LLM servers next to training"). Launched at
0, offline work raised the server's p99s by 6-12 %.

So the priority is chosen per GPU from what its online clients show: **0 once every online client
has stayed at or under** ``equal_priority_below`` (0.75) **of its SLOs for**
``share_min_interval`` (room for that rise and more, short of ``comfort_ratio``, where the duty
cycle starts to act), every live online client declaring an SLO and reporting (app latency covers
the GPU's online work) and the probe, where it reads, agreeing; **back to the configured priority
at the first SLO violation, or when the GPU has no online client left** (the evidence was theirs).
The choice reaches launches only: admissions, and relaunches under a new share. A running client
keeps its priority and is not restarted for it: a restart costs the job its start-up and its work
since the last checkpoint (issue 32), and the duty cycle already freezes a client that crowds
online work. ``equal_priority_below = 0`` turns the rule off; ``offline_mps_priority = 0`` needs no
rule. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import replace

from gpushare.config import ControlConfig
from gpushare.control.gpu_state import GpuState
from gpushare.control.signals import Signals
from gpushare.model import Action, SetOfflinePriority


def offline_priority(
    config: ControlConfig, state: GpuState, signals: Signals, now: float, actions: list[Action]
) -> GpuState:
    """Choose the GPU's offline launch priority this tick; the new state (see the module)."""
    configured = config.offline_mps_priority
    gpu = state.gpu_uuid
    if configured == 0 or config.equal_priority_below <= 0:
        # Nothing to choose. (A reload that turns the rule off starts a new policy, and the
        # daemon drops what the old one chose: daemon.loop.ControlLoop.restart_policy.)
        return state
    # Where every online client reports, app latency is what the SLOs are (the duty cycle's
    # rule too): the probe, which waits behind a saturating server's own kernels, is not.
    worst = signals.app_worst if signals.app_complete else signals.worst
    room = signals.app_complete and worst is not None and worst <= config.equal_priority_below
    since = state.priority_room_since_s if room else None
    if room and since is None:
        since = now
    if state.offline_priority is None:
        if since is not None and now - since >= config.share_min_interval_s:
            actions.append(
                SetOfflinePriority(
                    gpu,
                    0,
                    f"online latency at or under {config.equal_priority_below:g}x its SLOs for "
                    f"{now - since:.0f}s ({signals.app_source}): offline launches at the online "
                    "clients' MPS priority (0)",
                )
            )
            return replace(state, offline_priority=0, priority_room_since_s=since)
    elif signals.online == 0 or (worst is not None and worst > config.violation_ratio):
        why = "no online client left" if signals.online == 0 else f"online at {worst:.2f}x its SLO"
        actions.append(
            SetOfflinePriority(
                gpu,
                configured,
                f"{why}: offline launches below online clients again ({configured})",
            )
        )
        return replace(state, offline_priority=None, priority_room_since_s=None)
    if since != state.priority_room_since_s:
        return replace(state, priority_room_since_s=since)
    return state
