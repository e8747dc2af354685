"""Taking the recorded clients back after a daemon restart (or a crash), at any step it came in.

A client whose process still runs is re-adopted: paused and watched again, its latency and
in-flight sources reopened, a restart that was under way carried on (the relaunch happens when the
signalled process exits, as if the daemon had never stopped). A client whose process is gone:

* its cgroup's leftover processes are killed (children that outlived the main process would
  otherwise run unsupervised, beyond ``cancel``'s reach: issue 27), and the cgroup removed;
* a launch or a restart the daemon died in the middle of (STARTING with no process recorded,
  RESTARTING) goes back to the queue, so it is launched again: nothing was lost but a launch;
* any other ends LOST, with the reason and how many leftover processes were killed.

Adopted processes (``adopted_by``) are not the daemon's to kill: with their process gone they end
LOST and keep their cgroup, as the scheduler that made it expects.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import structlog

from gpushare.daemon import gangplace, launcher
from gpushare.daemon.freeze import HOLD
from gpushare.daemon.registry import ClientRecord
from gpushare.daemon.state import PAUSE_ERRORS
from gpushare.model import ClientState
from gpushare.node.procs.facts import read_environ

if TYPE_CHECKING:
    from gpushare.daemon.lifecycle import Lifecycle

log = structlog.get_logger(__name__)

S = ClientState


def readopt(life: Lifecycle) -> None:
    """Take back every recorded live client whose process runs; requeue or end the rest."""
    s = life.s
    with s.lock:
        for rec in s.registry.clients():
            if rec.state is S.QUEUED:
                continue
            alive = rec.start_time is not None and rec.pid is not None
            if alive and s.procs.alive(rec.pid or 0, rec.start_time or 0.0):
                _take_back(life, rec)
            else:
                _gone(life, rec)


def _take_back(life: Lifecycle, rec: ClientRecord) -> None:
    s, registry = life.s, life.s.registry
    if rec.adopted_by is not None:
        # Paused where it is again: its own cgroup, or signals.
        try:
            route = life.adopt_in_place(rec.id, rec.pid or 0, rec.start_time, owner_uid=rec.uid)
        except PAUSE_ERRORS as exc:
            route, why = None, f"cannot be paused any more: {exc}"
        else:
            why = "its process is gone"
        if route is None:
            registry.transition(rec.id, S.LOST, reason=f"{why} (re-adoption)")
            return
        registry.update(rec.id, pause_mechanism=route.mechanism.value)
    else:
        life.adopt_pid(rec.id, rec.pid or 0, start_time=rec.start_time, owner_uid=rec.uid)
    if rec.latency_from is not None:
        s.latency.add_prometheus(rec.id, rec.latency_from)
    if rec.inflight_from is not None:
        s.gauges.add(rec.id, rec.inflight_from)
    if rec.queue is not None and rec.pid is not None:
        # The queue it was launched with is in its environment.
        try:
            env = read_environ(rec.pid, launcher.SHALLOW_MARKERS) or {}
        except PermissionError:
            env = {}  # not root: taken as deep (an auto client may restart once)
        if (how := launcher.shallow_how(env)) is not None:
            life.note_shallow(rec.id, how)
        life.live.adopt(rec.id, rec.gpu_uuid, env)  # issue 32: its bound follows gating
    if rec.held:
        life.freeze_for(rec.id, HOLD)
    else:
        # It may have been frozen by a duty cycle when the daemon died.
        life.thaw_quietly(rec.id)
    registry.add_event(
        "client_readopted",
        f"client {rec.id} (pid {rec.pid}) re-adopted after a daemon restart",
        client_id=rec.id,
        gpu_uuid=rec.gpu_uuid,
    )
    if rec.state is S.STARTING:
        registry.transition(rec.id, S.RUNNING)
    elif rec.state is S.RESTARTING:
        # The checkpoint signal was sent: relaunched when it exits, killed if it stays too long.
        life.resume_restart(rec, rec.reason or "restart resumed after a daemon restart")


def _gone(life: Lifecycle, rec: ClientRecord) -> None:
    registry = life.s.registry
    killed = 0 if rec.adopted_by is not None else _kill_leftovers(life, rec)
    left = f"; {killed} leftover processes of its cgroup killed" if killed else ""
    interrupted = rec.state is S.RESTARTING or (rec.state is S.STARTING and rec.pid is None)
    # A gang goes back to the queue as a gang only where its record keeps its request
    # (gangplace.request_text); one from before would be queued on one GPU: it is gone instead.
    as_gang = gangplace.parse_request(rec.gpu_request) is not None
    if interrupted and rec.detach and rec.adopted_by is None and (len(rec.gang) <= 1 or as_gang):
        step = "restart" if rec.state is S.RESTARTING else "launch"
        registry.transition(
            rec.id, S.QUEUED, pid=None, start_time=None, gang=(),
            reason=f"the daemon stopped during its {step}; queued to be launched again{left}",
        )  # fmt: skip
        return
    why = "no process was recorded" if rec.pid is None else "its process is gone"
    registry.transition(rec.id, S.LOST, reason=f"{why} while the daemon was down{left}")


def _kill_leftovers(life: Lifecycle, rec: ClientRecord) -> int:
    """Kill what is left in a launched client's cgroup and remove it; how many were there."""
    pauser = life.s.pauser
    try:
        left = list(pauser.pids(rec.id))
        if left:
            log.warning("client_leftovers_killed", client_id=rec.id, pids=left)
            pauser.kill(rec.id)
    except PAUSE_ERRORS as exc:
        log.warning("client_leftovers_kill_failed", client_id=rec.id, error=str(exc))
        return 0
    with contextlib.suppress(*PAUSE_ERRORS):
        pauser.release(rec.id)
    return len(left)
