"""The client lifecycle: launch, adopt, reap, restart, evict, recover, and the registry moves.

:class:`Lifecycle` owns what the daemon knows of each client's process: the pid it watches, what to
do when it exits (set by cancel, evict, restart and MPS recovery), when it is to be killed, and
when a failed restartable job may run again. Why the daemon freezes a client it sets at the
:class:`~gpushare.daemon.freeze.FreezeArbiter`, which owns it, and asks it back from there. Launching is three steps so a
failure between them stays visible: :meth:`Lifecycle.prepare_launch` (the STARTING record),
:meth:`Lifecycle.spawn` (the process, outside the lock) and :meth:`Lifecycle.finish_launch` (the
registry write, then adoption: pauser attach and exit watch). Every method that changes state is
called under :attr:`NodeState.lock <gpushare.daemon.state.NodeState.lock>` (the exit watcher takes
it itself).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal

import structlog

from gpushare import mpsenv
from gpushare.control.controller import failure_backoff_s
from gpushare.daemon.clientenv import client_env
from gpushare.daemon.freeze import DAEMON_REASONS, DUTY, HOLD
from gpushare.daemon.inflight_control import LiveQueues
from gpushare.daemon.readopt import readopt
from gpushare.daemon.registry import ClientRecord, RegistryError
from gpushare.daemon.startcost import StartTimes
from gpushare.daemon.state import PAUSE_ERRORS, RUNNING_STATES, NodeState
from gpushare.model import ClientClass, ClientState, Evict, RecoverMps, RestartClient
from gpushare.node.base import Process
from gpushare.node.cgroups.route import FreezeRoute
from gpushare.node.procs.spawning import launch_failure

log = structlog.get_logger(__name__)

S = ClientState

Spawned = tuple[Process, float | None, Path] | str
"""What :meth:`Lifecycle.spawn` gives: the process, its start time and log, or why it failed."""


@dataclass(frozen=True, slots=True)
class _OnExit:
    """What to do when a client's process exits, set by cancel, evict and restart."""

    kind: Literal["cancel", "evict", "requeue", "restart"]
    reason: str
    sm_pct: float | None = None


class Lifecycle:
    """Clients' processes from spawn or adoption to their exit; see the module docstring."""

    def __init__(self, state: NodeState) -> None:
        self.s = state
        self._by_pid: dict[int, str] = {}
        self._on_exit: dict[str, _OnExit] = {}
        # Monotonic time at which a signalled client is SIGKILLed if it is still there.
        self._kill_at: dict[str, float] = {}
        # Monotonic time before which a requeued failed job is not admitted again.
        self._not_before: dict[str, float] = {}
        self._watching = False
        # Offline clients launched with a shallow queue, and how (``launcher.shallow_how``).
        self._shallow: dict[str, str] = {}
        # Issue 32: live ``--queue auto`` clients, whose bound follows gating without a restart.
        self.live = LiveQueues(lambda: self.s.bound_writer, self._shallow)
        # Issue 32: relaunched clients whose start-up the loop times (daemon.startcost).
        self.startup = StartTimes()

    # ----------------------------------------------------------------------------- queries

    @property
    def paused(self) -> frozenset[str]:
        """The clients the daemon holds frozen now (a duty-cycle freeze, a hold, the stop)."""
        return self.s.freeze.holding(DAEMON_REASONS)

    def is_paused(self, client_id: str) -> bool:
        """Whether the daemon holds the client frozen (a duty-cycle freeze, a hold, the stop)."""
        return self.s.freeze.has_any(client_id, DAEMON_REASONS)

    def going(self) -> tuple[str, ...]:
        """The clients told to go (cancel, evict, restart, recovery), in the order told."""
        return tuple(self._on_exit)

    def main_pids(self, clients: Mapping[str, object]) -> dict[int, str]:
        """The watched main pid of each of ``clients`` (pid -> client)."""
        return {pid: cid for pid, cid in self._by_pid.items() if cid in clients}

    def retry_times(self) -> dict[str, float]:
        """Per requeued failed job, the monotonic time before which it is not admitted again."""
        return dict(self._not_before)

    @property
    def shallow(self) -> Mapping[str, str]:
        """The offline clients launched with a shallow queue, and how (read-only)."""
        return MappingProxyType(self._shallow)

    def is_shallow(self, client_id: str) -> bool:
        """Whether the client was launched with a shallow queue."""
        return client_id in self._shallow

    def note_shallow(self, client_id: str, how: str) -> None:
        """A re-adopted client runs with a shallow queue (read from its environment)."""
        self._shallow[client_id] = how

    # ----------------------------------------------------------------------------- watching

    def start_watching(self) -> None:
        """Start the exit watch (before :meth:`readopt` and any launch)."""
        self.s.procs.start(self.process_exited)
        self._watching = True

    def stop_watching(self) -> None:
        """Stop the exit watch."""
        if self._watching:
            self.s.procs.stop()

    def exiting(self, client_id: str) -> bool:
        """Whether the client was told to go (cancel, evict, restart, recovery)."""
        return client_id in self._on_exit

    def client_of_pid(self, pid: int) -> str | None:
        """The client a process belongs to (its main pid or any pid of its cgroup)."""
        with self.s.lock:
            owner = self._by_pid.get(pid)
            if owner is not None:
                return owner
            for client_id in set(self._by_pid.values()):
                if pid in self.s.pauser.pids(client_id):
                    return client_id
            # pids() may be a few seconds behind a fork (node/cgroups/pid_tracker.py); the cgroup
            # pauser can also name the owner of one pid from its /proc/PID/cgroup.
            found = self.s.pauser.owner_of(pid)
            if found is not None and found in self._by_pid.values():
                return found
        return None

    def uid_of_client(self, client_id: str) -> int | None:
        """The owner of a live client."""
        rec = self.s.registry.find(client_id)
        return rec.uid if rec is not None and rec.state.is_live else None

    # ----------------------------------------------------------------------------- adoption

    def readopt(self) -> None:
        """Take back the recorded clients after a daemon restart (:mod:`gpushare.daemon.readopt`)."""
        assert self._watching
        readopt(self)

    def resume_restart(self, rec: ClientRecord, reason: str) -> None:
        """Carry on a restart the daemon stopped during: relaunch at exit, SIGKILL after the grace."""
        self._on_exit[rec.id] = _OnExit("restart", reason)
        self._kill_at[rec.id] = self.s.clock.monotonic() + self.s.config.daemon.cancel_grace_s

    def adopt_pid(
        self,
        client_id: str,
        proc: Process,
        start_time: float | None = None,
        *,
        owner_uid: int,
    ) -> None:
        """Put a client's process under the pauser and the exit watch (a pauser failure is logged).

        For processes the daemon did not just spawn (the caller of a foreground submit, a
        re-adopted one), which keep running whether or not the pauser takes them.
        """
        pid = proc if isinstance(proc, int) else proc.pid
        try:
            # owner_uid: a pid handed to the daemon must never let one user freeze or kill
            # another user's process.
            self.s.pauser.attach(client_id, pid, owner_uid=owner_uid)
        except PAUSE_ERRORS as exc:
            log.warning("pauser_attach_failed", client_id=client_id, pid=pid, error=str(exc))
        self._watch(client_id, proc, start_time)

    def _watch(self, client_id: str, proc: Process, start_time: float | None) -> None:
        assert self._watching
        self._by_pid[proc if isinstance(proc, int) else proc.pid] = client_id
        self.s.procs.watch(proc, start_time)

    def adopt_foreground(
        self, client_id: str, pid: int, start_time: float | None, *, owner_uid: int
    ) -> ClientRecord:
        """Adopt the process of a foreground submit (it execs the workload itself): RUNNING."""
        self.adopt_pid(client_id, pid, start_time, owner_uid=owner_uid)
        return self.s.registry.transition(
            client_id, S.RUNNING, pid=pid, start_time=start_time, started_at=self.s.clock.time()
        )

    def adopt_in_place(
        self, client_id: str, pid: int, start_time: float | None, *, owner_uid: int
    ) -> FreezeRoute | None:
        """Take a process gpushare did not start, where it is: pauser ``adopt`` and exit watch.

        Returns:
            How it is paused, or ``None`` when it exited before it could be adopted.
        """
        assert self._watching
        try:
            # A pauser that cannot adopt where a process is attaches it (PauserDefaults.adopt).
            route = self.s.pauser.adopt(client_id, pid, owner_uid=owner_uid)
        except PAUSE_ERRORS as exc:
            log.warning("adopt_failed", client_id=client_id, pid=pid, error=str(exc))
            if start_time is None or not self.s.procs.alive(pid, start_time):
                return None
            raise
        self._watch(client_id, pid, start_time)
        return route

    def release_adopted(self, client_id: str, reason: str) -> None:
        """End an adopted client without touching its processes (thawed, no longer controlled)."""
        rec = self.s.registry.get(client_id)
        if rec.pid is not None:
            self._by_pid.pop(rec.pid, None)
        # Its freezes end with the daemon's control; the pauser is released just below, so
        # nothing is requested.
        self.s.freeze.forget(client_id)
        self._kill_at.pop(client_id, None)
        self._on_exit.pop(client_id, None)
        self.s.latency.forget(client_id)
        self.s.gauges.forget(client_id)  # its poll's connection ends with it
        try:
            self.s.pauser.release(client_id)
        except PAUSE_ERRORS as exc:
            log.warning("pauser_release_failed", client_id=client_id, error=str(exc))
        self.s.transition(client_id, S.EXITED, reason=reason)

    # ----------------------------------------------------------------------------- pausing

    def thaw_quietly(self, client_id: str) -> None:
        """Thaw whatever the pauser holds of the client, whether or not the daemon froze it."""
        try:
            self.s.pauser.thaw(client_id)
        except PAUSE_ERRORS as exc:
            log.warning("thaw_failed", client_id=client_id, error=str(exc))

    def freeze_for(self, client_id: str, *reasons: str) -> None:
        """Make ``reasons`` the daemon's freeze reasons of a client (none: the daemon lets it run).

        Through the :class:`~gpushare.daemon.freeze.FreezeArbiter`, in one step: a reason that
        replaces another never thaws the client in between, and a client with no reason left
        from the daemon stays frozen while its GPU's request gate holds it. A pauser failure is
        logged (the reasons stay as they were: the next tick tries again).
        """
        want = frozenset(reasons)
        try:
            self.s.freeze.change([client_id], add=want, drop=DAEMON_REASONS - want)
        except PAUSE_ERRORS as exc:
            log.warning("pause_failed", client_id=client_id, paused=bool(want), error=str(exc))

    def freeze_all(self, ids: list[str], reason: str = DUTY) -> None:
        """Freeze several clients: all requests first, then the waits (one freeze latency)."""
        ids = [client_id for client_id in ids if not self.is_paused(client_id)]
        try:
            self.s.freeze.set(ids, reason, True)
        except PAUSE_ERRORS as exc:
            log.warning("freeze_many_failed", clients=ids, error=str(exc))

    def release_duty_freezes(self) -> None:
        """Thaw the clients the daemon froze; a user's or controller's hold stays."""
        with self.s.lock:
            for client_id in self.paused:
                rec = self.s.registry.find(client_id)
                if rec is not None and not rec.held:
                    self.freeze_for(client_id)

    def hold(self, client_id: str, held: bool, reason: str) -> None:
        """Hold a client frozen (a user's pause, a controller's Freeze) or release the hold."""
        rec = self.s.registry.get(client_id)
        if not rec.state.is_live or rec.held == held:
            return
        self.s.registry.update(client_id, held=held)
        if held:
            self.freeze_for(client_id, HOLD)
            self.s.transition(client_id, S.FROZEN, reason=reason)
        else:
            # A gang runs at the smallest duty of its GPUs (as the duty cycle's phase has it).
            duty = min((self.s.duty.get(u, 1.0) for u in rec.gpus()), default=1.0)
            offline = rec.cls is ClientClass.OFFLINE
            # An offline client at duty 0 stays frozen, now for the duty cycle.
            self.freeze_for(client_id, *((DUTY,) if offline and duty <= 0.0 else ()))
            self.s.transition(
                client_id, S.THROTTLED if offline and duty < 1.0 else S.RUNNING, reason=reason
            )

    # ----------------------------------------------------------------------------- ending

    def cancel(self, rec: ClientRecord, who: str) -> float:
        """SIGTERM a live client now and SIGKILL it after ``daemon.cancel_grace``; the grace."""
        grace = self.s.config.daemon.cancel_grace_s
        self._on_exit[rec.id] = _OnExit("cancel", f"cancelled by {who}")
        # A frozen process cannot act on SIGTERM: thaw it so it can shut down cleanly.
        self.freeze_for(rec.id)
        if rec.held:
            self.thaw_quietly(rec.id)
        self.signal(rec, signal.SIGTERM)
        self._kill_at[rec.id] = self.s.clock.monotonic() + grace
        self.s.registry.add_event(
            "client_cancel", f"{who} cancelled {rec.id}; SIGKILL in {grace:g}s if it stays",
            client_id=rec.id, gpu_uuid=rec.gpu_uuid,
        )  # fmt: skip
        return grace

    def restart(self, action: RestartClient, now: float) -> None:
        """Checkpoint-signal a restartable client; it is launched again when it exits."""
        rec = self.s.registry.get(action.client_id)
        if rec.state not in RUNNING_STATES or not rec.restartable or rec.pid is None:
            return
        self._on_exit[rec.id] = _OnExit("restart", action.reason, action.sm_pct)
        self.freeze_for(rec.id)
        self.signal(rec, rec.checkpoint_signal)
        self.s.transition(rec.id, S.RESTARTING, reason=action.reason)
        self._kill_at[rec.id] = now + self.s.config.daemon.cancel_grace_s

    def evict(self, action: Evict, now: float) -> None:
        """End a client's GPU work and its process (requeued when restartable and asked)."""
        rec = self.s.registry.get(action.client_id)
        if rec.state not in RUNNING_STATES or rec.pid is None or rec.gpu_uuid is None:
            return
        requeue = action.requeue and rec.restartable
        self._on_exit[rec.id] = _OnExit("requeue" if requeue else "evict", action.reason)
        self.s.ops.evicted(rec.id, rec.gpu_uuid)
        self.freeze_for(rec.id)
        # MPS forbids killing a client with GPU work in flight: terminate_client first.
        ok = self.s.mps.terminate_client(rec.gpu_uuid, rec.pid)
        self.s.registry.add_event(
            "client_evicting",
            f"evicting {rec.id}: {action.reason} (terminate_client {'ok' if ok else 'failed'})",
            severity="warning", client_id=rec.id, gpu_uuid=rec.gpu_uuid,
        )  # fmt: skip
        self._kill_at[rec.id] = now + self.s.config.control.evict_grace_s

    def recover(self, action: RecoverMps, now: float) -> None:
        """Recover a GPU's faulted MPS server; its offline clients are made to go first."""
        recs = [r for r in self.s.registry.clients() if action.gpu_uuid in r.gpus()]
        pids = {c: [r.pid for r in recs if r.cls is c and r.pid] for c in ClientClass}
        self.s.registry.add_event(
            "mps_recovery", f"MPS recovery: {action.reason}", severity="warning",
            gpu_uuid=action.gpu_uuid,
        )  # fmt: skip
        # A faulted server takes no new client until every old one has exited, and
        # terminate_client ends a client's GPU work, not its process: the offline processes are
        # made to go (SIGKILL after evict_grace). The fault is not counted as their failure:
        # restartable ones go back to the queue, the others end with the recovery as reason.
        grace = self.s.config.control.evict_grace_s
        for rec in recs:
            if (
                rec.cls is ClientClass.OFFLINE
                and rec.state in RUNNING_STATES
                and rec.pid is not None
                and rec.id not in self._on_exit
            ):
                requeue = rec.restartable and rec.detach
                why = f"MPS recovery: {action.reason}"
                self._on_exit[rec.id] = _OnExit("requeue" if requeue else "evict", why)
                self.s.ops.evicted(rec.id, action.gpu_uuid)
                self.freeze_for(rec.id)
                self._kill_at[rec.id] = now + grace
        self.s.mps.recover(action.gpu_uuid, pids[ClientClass.OFFLINE], pids[ClientClass.ONLINE])

    def signal(self, rec: ClientRecord, sig: int) -> None:
        """Send a signal to the client's process group (or each of its processes)."""
        if rec.pid is None:
            return
        # Every process now: pids() may list one that exited since its last re-read
        # (node/cgroups/pid_tracker.py), and a signal must reach a just-forked one too.
        self.s.procs.signal(rec.pid, sig, self.s.pauser.members(rec.id))

    def kill_overdue(self, now: float) -> None:
        """SIGKILL the signalled clients whose grace is over."""
        for client_id, at in list(self._kill_at.items()):
            if now >= at:
                del self._kill_at[client_id]
                log.info("client_kill", client_id=client_id)
                try:
                    self.s.pauser.kill(client_id)
                except PAUSE_ERRORS as exc:
                    log.warning("kill_failed", client_id=client_id, error=str(exc))

    def process_exited(self, pid: int, code: int | None) -> None:
        """The exit watcher's callback: record how the client ended and what comes next."""
        with self.s.lock:
            client_id = self._by_pid.pop(pid, None)
            if client_id is None:
                return
            self._kill_at.pop(client_id, None)
            self.s.latency.forget(client_id)
            self.s.gate.forget(client_id)  # and its freeze reasons at the arbiter
            self.s.gauges.forget(client_id)
            self._shallow.pop(client_id, None)  # a relaunch decides its queue anew
            self.live.forget(client_id)
            self.startup.forget(client_id)
            then, rec = self._on_exit.pop(client_id, None), self.s.registry.get(client_id)
            try:
                if rec.gang and rec.restartable:  # a rank left must not run beside a relaunch
                    self.s.pauser.kill(client_id)
                self.s.pauser.release(client_id)
            except PAUSE_ERRORS as exc:
                log.warning("pauser_release_failed", client_id=client_id, error=str(exc))
            log.info("client_process_exited", client_id=client_id, pid=pid, exit_code=code)
            transition = self.s.transition
            if then is not None and then.kind == "restart" and rec.gpu_uuid is not None:
                sm = then.sm_pct if then.sm_pct is not None else rec.sm_pct
                self.launch_detached(
                    rec, rec.gpu_uuid, sm, f"restarted: {then.reason}", restart=True
                )
            elif then is not None and then.kind == "requeue":
                transition(client_id, S.QUEUED, reason=then.reason, exit_code=code, pid=None)
            elif then is not None and then.kind == "evict":
                transition(client_id, S.FAILED, reason=f"evicted: {then.reason}", exit_code=code)
            elif then is not None and then.kind == "cancel":
                transition(client_id, S.EXITED, reason=then.reason, exit_code=code)
            elif code is None:
                transition(client_id, S.EXITED, reason="exit status not visible to the daemon")
            elif code == 0:
                transition(client_id, S.EXITED, exit_code=0)
            else:
                why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                hint = launch_failure(code)
                if hint:
                    why += f" (probably: {hint}; see {rec.log_path or 'its log'})"
                failures = rec.failures + 1
                control = self.s.config.control
                if rec.restartable and rec.detach and failures < control.max_client_failures:
                    # A restartable job goes back to the queue, after a growing backoff.
                    backoff = failure_backoff_s(failures, control)
                    self._not_before[client_id] = self.s.clock.monotonic() + backoff
                    transition(
                        client_id, S.QUEUED, reason=f"{why}; retry in {backoff:g}s",
                        exit_code=code, failures=failures, pid=None,
                    )  # fmt: skip
                else:
                    if rec.restartable and failures >= control.max_client_failures:
                        why += f" ({failures} failures in a row: not retried)"
                    transition(client_id, S.FAILED, reason=why, exit_code=code, failures=failures)

    # ----------------------------------------------------------------------------- launching

    def launch_detached(
        self,
        rec: ClientRecord,
        gpu_uuid: str,
        sm_pct: float | None,
        reason: str,
        *,
        restart: bool = False,
    ) -> ClientRecord:
        """STARTING, spawn and adopt, all under the caller's lock (admission, relaunch)."""
        rec = self.prepare_launch(rec, gpu_uuid, sm_pct, reason)
        return self.finish_launch(rec, self.spawn(rec), restart=restart)

    def prepare_launch(
        self, rec: ClientRecord, gpu_uuid: str, sm_pct: float | None, reason: str
    ) -> ClientRecord:
        """Move a queued or restarting client to STARTING on its GPU with its share and priority."""
        sample = self.s.sample(gpu_uuid)
        sm = sm_pct if sm_pct is not None else self.s.default_sm(rec.cls, gpu_uuid)
        # No pid until the spawn is recorded: a daemon dying before then requeues it (readopt.py).
        moved = self.s.transition(
            rec.id, S.STARTING, reason=reason, gpu_uuid=gpu_uuid, sm_pct=sm, pid=None,
            gpu_index=sample.index if sample else rec.gpu_index, start_time=None,
            priority=self.s.priority(rec.cls, rec.gang or (gpu_uuid,)),
        )  # fmt: skip
        return moved or self.s.registry.get(rec.id)

    def spawn(self, rec: ClientRecord) -> Spawned:
        """Start a STARTING client's process; the failure text instead when it cannot start.

        Needs no lock: it reads only the record, so API threads spawn in parallel.
        """
        assert rec.gpu_uuid is not None
        sm = rec.sm_pct if rec.sm_pct is not None else 100.0
        env = self.mps_env(
            rec.id, rec.gpu_uuid, sm, rec.mem_bytes, rec.cls, rec.slo_p99_ms, queue=rec.queue,
            gang=rec.gang,
        )  # fmt: skip
        # With the cgroup freezer the child joins its cgroup before it execs, so a workload that
        # forks at once cannot leave a process outside the freezer's reach.
        procs_fd: int | None = None
        try:
            procs_fd = self.s.pauser.open_procs_fd(rec.id)
            return self.s.procs.spawn(
                rec.argv,
                uid=rec.uid,
                gid=rec.gid,
                cwd=rec.cwd or "/",
                env=mpsenv.workload_env(rec.env, env),
                log_dir=self.s.config.paths.resolved("client_log_dir"),
                client_id=rec.id,
                cgroup_procs_fd=procs_fd,
            )
        except (OSError, ValueError) as exc:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            return f"cannot start: {detail}"
        except PAUSE_ERRORS as exc:
            return f"cannot start: the client's cgroup cannot be used: {exc}"
        finally:
            if procs_fd is not None:
                os.close(procs_fd)

    def finish_launch(
        self, rec: ClientRecord, spawned: Spawned, *, restart: bool = False
    ) -> ClientRecord:
        """Record a spawned process and adopt it (or fail the client with the spawn's error).

        Any failure after the spawn (the registry write, the pauser's attach, the node refusing
        the client's limits) stops the process, removes its cgroup and ends the client FAILED
        with the reason and no pid: a failed launch leaves nothing running and nothing STARTING.
        """
        if isinstance(spawned, str):
            return self.s.transition(rec.id, S.FAILED, reason=spawned) or rec
        proc, start_time, log_path = spawned
        pid = proc if isinstance(proc, int) else proc.pid
        try:
            # Recorded before the exit watch: a process that is already gone is still traceable.
            self.s.registry.update(
                rec.id, pid=pid, start_time=start_time, started_at=self.s.clock.time(),
                log_path=str(log_path), pause_mechanism=self.s.pauser.mechanism.value,
                restarts=rec.restarts + (1 if restart else 0),
            )  # fmt: skip
            # Strict, unlike re-adoption: a client the daemon cannot freeze, or whose limits the
            # node refuses, must not run as if it were under control.
            self.s.pauser.attach(rec.id, pid, owner_uid=rec.uid)
        except (*PAUSE_ERRORS, RegistryError, sqlite3.Error) as exc:
            return self._abort_launch(rec, proc, f"cannot start: {exc}")
        self._watch(rec.id, proc, start_time)
        if restart and rec.gpu_uuid is not None:  # issue 32: a restart's cost, measured
            self.startup.spawned(rec.id, rec.gpu_uuid, self.s.clock.monotonic())
        current = self.s.registry.get(rec.id)
        if current.state is S.STARTING:  # not already ended by a prompt exit
            current = self.s.transition(rec.id, S.RUNNING) or current
        return current

    def _abort_launch(self, rec: ClientRecord, proc: Process, reason: str) -> ClientRecord:
        """Undo a launch that failed after its spawn: kill, reap, remove the cgroup, FAILED."""
        pid = proc if isinstance(proc, int) else proc.pid
        log.warning("launch_aborted", client_id=rec.id, pid=pid, reason=reason)
        try:
            self.s.pauser.kill(rec.id)  # the whole cgroup, children included, when it has one
        except PAUSE_ERRORS as exc:
            log.warning("launch_abort_kill_failed", client_id=rec.id, error=str(exc))
        # The pauser may not know the process (its attach is what failed): its own session.
        with contextlib.suppress(PermissionError):
            self.s.procs.signal(pid, signal.SIGKILL, [pid])
        if not self.s.procs.reap(proc, self.s.config.daemon.cancel_grace_s + 5.0):
            log.warning("launch_abort_unreaped", client_id=rec.id, pid=pid)
        try:
            self.s.pauser.release(rec.id)
        except PAUSE_ERRORS as exc:
            log.warning("launch_abort_release_failed", client_id=rec.id, error=str(exc))
        self.s.registry.add_event(
            "client_failed", f"{rec.id} could not start: {reason}",
            client_id=rec.id, gpu_uuid=rec.gpu_uuid,
        )  # fmt: skip
        failed = self.s.transition(rec.id, S.FAILED, reason=reason, pid=None, start_time=None)
        return failed or self.s.registry.get(rec.id)

    def mps_env(
        self,
        client_id: str,
        gpu_uuid: str,
        sm: float,
        mem: int | None,
        cls: ClientClass,
        slo_p99_ms: float | None = None,
        *,
        queue: str | None = None,
        announce: bool = True,
        gang: Sequence[str] = (),
    ) -> dict[str, str]:
        """The environment a client of this GPU starts with.

        :func:`gpushare.daemon.clientenv.client_env`; an offline client's queue mode is kept
        (:attr:`shallow`) and logged as ``offline_queue`` unless ``announce`` is false (a caller
        that only shows the environment while :meth:`spawn` computes it again, which logs it).
        """
        env, choice = client_env(self.s, client_id, gpu_uuid, sm, mem, cls, slo_p99_ms,
                                 queue=queue, live=self.live, gang=gang)  # fmt: skip
        if choice is not None:
            # A live client's shallow mark is LiveQueues' to keep (issue 32).
            if not choice.live and choice.shallow_how is not None:
                self._shallow[client_id] = choice.shallow_how
            elif not choice.live:
                self._shallow.pop(client_id, None)
            if announce:
                log.info(
                    "offline_queue", client_id=client_id, queue=choice.mode, reason=choice.why,
                    how=choice.how,
                )  # fmt: skip
        return env
