"""The daemon's API: request handlers, their checks, and who may act on which client.

:class:`Api` answers the requests of :mod:`gpushare.protocol` on the server's threads: ``status``,
``list`` and ``events`` read the node; ``submit`` checks a request against the node, places it on a
GPU and hands it to the :class:`~gpushare.daemon.lifecycle.Lifecycle`; ``cancel``, ``pause`` and
``resume`` act on a client after checking that the caller owns it (or is root or an admin). A bad
request gets a :class:`~gpushare.protocol.ProtocolError` that names the fix and changes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import math
import signal
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from gpushare import mpsenv, protocol
from gpushare.control import fit, placement
from gpushare.control.promise import PlacedClient, may_promise, promised_bytes
from gpushare.daemon import gangplace, submitq
from gpushare.daemon.adopter import Adoptions
from gpushare.daemon.cordon import CordonApi
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.loop import ControlLoop
from gpushare.daemon.registry import ClientRecord, RegistryUnavailableError
from gpushare.daemon.rights import as_seen, is_privileged
from gpushare.daemon.server import Caller
from gpushare.daemon.state import PAUSE_ERRORS, RUNNING_STATES, NodeState
from gpushare.daemon.views import Views, resolve_gpu
from gpushare.model import ClientClass, ClientState, GpuSample, MpsState
from gpushare.node.procs.facts import process_cgroup
from gpushare.node.procs.identity import process_start_time
from gpushare.node.procs.users import user_in_group, user_name

log = structlog.get_logger(__name__)

S = ClientState
E = protocol.ErrorCode
_MAX_NAME = 64

Handler = Callable[[Caller, dict[str, Any]], Any]


def _fail(code: protocol.ErrorCode, message: str) -> protocol.ProtocolError:
    return protocol.ProtocolError(code, message)


def _check_online_source(
    flag: str, value: str | None, cls: ClientClass, parse: Callable[[str], object]
) -> None:
    """A ``--*-from`` source of an online client's signal: only for --online, and well formed."""
    if value is None:
        return
    if cls is not ClientClass.ONLINE:
        raise _fail(protocol.ErrorCode.INVALID_PARAMS, f"{flag} applies to --online clients only")
    try:
        parse(value)
    except ValueError as exc:
        raise _fail(protocol.ErrorCode.INVALID_PARAMS, f"{flag}: {exc}") from None


class Api:
    """The request handlers; :meth:`methods` is the dispatch table the server is given."""

    def __init__(
        self,
        state: NodeState,
        lifecycle: Lifecycle,
        loop: ControlLoop,
        adoptions: Adoptions | None = None,
    ) -> None:
        self.s = state
        self.life = lifecycle
        self.loop = loop
        self.adoptions = adoptions
        self.cordon = CordonApi.of(state, self._resolve_gpu)
        self.views = Views(state, lifecycle, loop, state.clock.monotonic(), self.cordon)

    def methods(self) -> dict[str, Handler]:
        """The explicit dispatch table of the API (``hello`` is answered by the server)."""

        def seen(handler: Handler, *, shared: bool = False) -> Handler:
            # What others may not see of a client is taken out of every answer that shows one.
            return as_seen(
                handler, lambda: self.s.config.daemon.admin_group, self.s.registry, shared=shared
            )

        return {
            protocol.STATUS: seen(self.status, shared=True),
            protocol.LIST: seen(self.list, shared=True),
            protocol.EVENTS: seen(self.events),
            protocol.SUBMIT: self.submit,
            protocol.CANCEL: self.cancel,
            protocol.PAUSE: self.pause,
            protocol.RESUME: self.resume,
            protocol.ADOPT: self.adopt,
            protocol.RELEASE: self.release,
            protocol.DRAIN: self.cordon.drain,
            protocol.UNDRAIN: self.cordon.undrain,
        }

    # ----------------------------------------------------------------------------- rights

    def _authorize(self, caller: Caller, rec: ClientRecord, what: str) -> None:
        if caller.uid in (0, rec.uid):
            return
        admin = self.s.config.daemon.admin_group
        if admin:
            try:
                admin_gid = grp.getgrnam(admin).gr_gid
            except KeyError:
                admin_gid = None
            if admin_gid is not None and (admin_gid == caller.gid or admin_gid in caller.groups):
                return
            if user_in_group(caller.uid, admin):
                return
        who = f"root or members of group {admin!r}" if admin else "root"
        raise _fail(
            E.PERMISSION_DENIED,
            f"{user_name(caller.uid)} may not {what} {rec.id}, which belongs to "
            f"{rec.user}; only its owner or {who} may",
        )

    def _get(self, client_id: str) -> ClientRecord:
        rec = self.s.registry.find(client_id)
        if rec is None:
            raise _fail(E.NOT_FOUND, f"no client {client_id!r}; see `gpushare list --all`")
        return rec

    # ----------------------------------------------------------------------------- reading

    def status(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``status``: GPUs and clients (schema in docs/status-schema.md; :mod:`.views`)."""
        req = protocol.from_params(protocol.StatusRequest, params)
        return self.views.status(req.gpu, caller.uid)

    def list(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``list``: clients (live and queued, or all; :mod:`.views`)."""
        req = protocol.from_params(protocol.ListRequest, params)
        return self.views.clients(include_final=req.all, viewer=caller.uid)

    def events(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``events``: the event log after ``since_id`` (:mod:`.views`)."""
        req = protocol.from_params(protocol.EventsRequest, params)
        if req.since_id < 0 or not 1 <= req.limit <= 10_000:
            raise _fail(E.INVALID_PARAMS, "since_id must be >= 0 and limit in 1..10000")
        return self.views.events(req.since_id, req.limit)

    def cancel(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``cancel``: SIGTERM now, SIGKILL after ``daemon.cancel_grace``; a queued job just ends."""
        req = protocol.from_params(protocol.ClientRequest, params)
        with self.s.lock:
            rec = self._get(req.client_id)
            self._authorize(caller, rec, "cancel")
            who = user_name(caller.uid)
            if rec.state is S.QUEUED:
                self.s.registry.transition(rec.id, S.EXITED, reason=f"cancelled by {who}")
                return {"client_id": rec.id, "state": S.EXITED.value, "grace_s": 0.0}
            if not rec.state.is_live or rec.pid is None:
                raise _fail(E.CONFLICT, f"client {rec.id} is {rec.state.value}; nothing to cancel")
            grace = self.life.cancel(rec, who)
            return {"client_id": rec.id, "state": rec.state.value, "grace_s": grace}

    def adopt(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``adopt``: register a scheduler job whose processes become clients (see AdoptRequest)."""
        privileged = is_privileged(caller, self.s.config.daemon.admin_group)
        return self._adoptions().register(caller.uid, params, privileged=privileged)

    def release(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``release``: end a job's registration and its clients (thawed, not killed)."""
        privileged = is_privileged(caller, self.s.config.daemon.admin_group)
        return self._adoptions().release(caller.uid, params, privileged=privileged)

    def _adoptions(self) -> Adoptions:
        if self.adoptions is None:
            raise _fail(E.UNAVAILABLE, "this daemon does not adopt processes")
        return self.adoptions

    def pause(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``pause``: hold a client frozen until ``resume``."""
        return self._hold(caller, params, held=True)

    def resume(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``resume``: release a ``pause``."""
        return self._hold(caller, params, held=False)

    def _hold(self, caller: Caller, params: dict[str, Any], *, held: bool) -> dict[str, Any]:
        what = "pause" if held else "resume"
        req = protocol.from_params(protocol.ClientRequest, params)
        with self.s.lock:
            rec = self._get(req.client_id)
            self._authorize(caller, rec, what)
            if rec.state not in RUNNING_STATES:
                raise _fail(E.CONFLICT, f"client {rec.id} is {rec.state.value}; cannot {what} it")
            self.life.hold(rec.id, held, f"{what}d by {user_name(caller.uid)}")
            return {"client_id": rec.id, "state": self.s.registry.get(rec.id).state.value}

    def _resolve_gpu(self, key: str) -> GpuSample:
        return resolve_gpu(self.s.samples, key)

    def _add_client(self, **fields: Any) -> ClientRecord:
        try:
            return self.s.registry.add_client(**fields)
        except RegistryUnavailableError as exc:  # a full disk: the clients running stay controlled
            raise _fail(E.UNAVAILABLE, str(exc)) from None

    def submit(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``submit``: validate against the node, register, and adopt (foreground) or spawn."""
        req = protocol.from_params(protocol.SubmitRequest, params)
        if req.wait_for is not None:
            return self._wait_for(caller, req.wait_for)
        cls = self._check_submit(req, caller)
        if cls is ClientClass.OFFLINE and req.queue is None:
            # Issue 32: auto by default (the record keeps it; older records keep None = deep).
            req = dataclasses.replace(req, queue=protocol.DEFAULT_OFFLINE_QUEUE)
        detach = req.detach or req.restartable
        with self.s.lock:
            try:
                if req.gpus is not None:
                    gang, sm = self._place_gang(req, cls, caller.uid)
                    sample = gang[0]
                else:
                    sample, sm = self._place(req, cls, caller.uid)
                    gang = [sample]
                if (
                    cls is ClientClass.OFFLINE
                    and not req.no_queue
                    and submitq.waiting_ahead(self.s.registry.clients())
                ):
                    # It fits, but jobs already wait: it takes its place by the admission rules.
                    raise _fail(E.NO_CAPACITY, "offline jobs are already waiting for a GPU")
            except protocol.ProtocolError as exc:
                if (cls is not ClientClass.OFFLINE or exc.code is not E.NO_CAPACITY
                        or req.no_queue or self._never_fits(req)):  # fmt: skip
                    raise
                return self._enqueue(req, cls, caller, detach, exc.message)
            uuids = tuple(g.uuid for g in gang)  # [sample] for one GPU
            rec = self._add_client(
                cls=cls, argv=req.argv, uid=caller.uid, gid=caller.gid,
                user=user_name(caller.uid), state=S.STARTING, priority=self.s.priority(cls, uuids),
                name=req.name, gpu_uuid=sample.uuid, gpu_index=sample.index,
                gpu_request=gangplace.request_of(req, self.s.samples, self._resolve_gpu),
                sm_ceiling=req.sm_pct, sm_pct=sm,
                mem_bytes=req.mem_bytes, slo_p99_ms=req.slo_p99_ms, restartable=req.restartable,
                checkpoint_signal=req.checkpoint_signal, detach=detach,
                env=req.env if detach else {}, cwd=req.cwd,
                pause_mechanism=self.s.pauser.mechanism.value,
            )  # fmt: skip
            rec = self._record_extras(rec, req, uuids)
            # Detached, spawn() computes the environment again for the launch and logs the queue.
            env = self.life.mps_env(
                rec.id, sample.uuid, sm, req.mem_bytes, cls, req.slo_p99_ms,
                queue=req.queue, announce=not detach, gang=rec.gang,
            )  # fmt: skip
            if not detach:
                assert caller.pid > 0
                rec = self._take_caller(rec.id, caller)
        if detach:
            # Spawned outside the lock: concurrent submits fork in parallel; the STARTING
            # record already holds its MPS slot and memory against other submits.
            spawned = self.life.spawn(rec)
            with self.s.lock:
                rec = self.life.finish_launch(rec, spawned)
            if rec.state is S.FAILED and rec.pid is None:
                raise _fail(E.INVALID_PARAMS, rec.reason or "the workload could not start")
        with self.s.lock:
            log.info("client_submitted", client_id=rec.id, cls=cls.value, gpu=sample.uuid,
                     uid=caller.uid, detach=detach)  # fmt: skip
            result = protocol.SubmitResult(
                client_id=rec.id, gpu_uuid=sample.uuid, state=rec.state.value, env=env,
                log_path=rec.log_path, pid=rec.pid, unset_env=list(mpsenv.UNSET_ENV),
            )  # fmt: skip
            return protocol.as_dict(result)

    def _record_extras(
        self, rec: ClientRecord, req: protocol.SubmitRequest, gang: tuple[str, ...]
    ) -> ClientRecord:
        """What a submit asks beyond the basic record, recorded; its latency sources started."""
        if len(gang) > 1:
            rec = self.s.registry.update(rec.id, gang=gang)
        if req.slo_ttft_p99_ms is not None or req.slo_tpot_p99_ms is not None:
            rec = self.s.registry.update(
                rec.id, slo_ttft_p99_ms=req.slo_ttft_p99_ms, slo_tpot_p99_ms=req.slo_tpot_p99_ms
            )
        if req.latency_from is not None:
            self.s.registry.update(rec.id, latency_from=req.latency_from)
            self.s.latency.add_prometheus(rec.id, req.latency_from)
        if req.inflight_from is not None or req.queue is not None:
            rec = self.s.registry.update(rec.id, inflight_from=req.inflight_from, queue=req.queue)
        if req.restart_cost_s is not None:  # issue 32
            rec = self.s.registry.update(rec.id, restart_cost_s=req.restart_cost_s)
        if req.inflight_from is not None:
            self.s.gauges.add(rec.id, req.inflight_from)
        return rec

    def _take_caller(self, client_id: str, caller: Caller) -> ClientRecord:
        """Adopt a foreground submitter, which then execs the workload: RUNNING.

        Inside a Slurm job or a container it stays in its cgroup and is paused there (as the
        adopter takes processes); anywhere else it moves into a cgroup of gpushare's own.
        """
        start_time = process_start_time(caller.pid)
        where = submitq.managed_cgroup(process_cgroup(caller.pid))
        if where is None:
            return self.life.adopt_foreground(
                client_id, caller.pid, start_time, owner_uid=caller.uid
            )
        route = self.life.adopt_in_place(client_id, caller.pid, start_time, owner_uid=caller.uid)
        if route is None:
            return self.s.registry.transition(
                client_id, S.EXITED, reason="the submitting process exited before its adoption"
            )
        log.info("foreground_in_place", client_id=client_id, pid=caller.pid, cgroup=where)
        self.s.registry.update(client_id, pause_mechanism=route.mechanism.value)
        return self.s.registry.transition(
            client_id, S.RUNNING, pid=caller.pid, start_time=start_time,
            started_at=self.s.clock.time(), reason=f"runs in place, in {where}",
        )  # fmt: skip

    # ----------------------------------------------------------------------------- the queue

    def _never_fits(self, req: protocol.SubmitRequest) -> bool:
        """Whether no GPU could ever hold this offline job (then it is refused, not queued).

        A gang: fewer of its GPUs (those it names, or the shared ones) than its ranks.
        """
        n, gpus = 1, [g for g in self.s.samples if self.s.shared(g)]
        if req.gpus is not None:
            n, named = gangplace.parse(req.gpus, gpus, self._resolve_gpu)
            gpus = named or gpus
        elif req.gpu != "any":
            gpus = [self._resolve_gpu(req.gpu)]
        need = req.mem_bytes or 0
        return sum(gangplace.may_ever_fit(g, need, self.s.reserve(g)) for g in gpus) < n

    def _enqueue(
        self, req: protocol.SubmitRequest, cls: ClientClass, caller: Caller, detach: bool, why: str
    ) -> dict[str, Any]:
        """Record an offline submit ``queued``: admission starts it when a GPU can hold it."""
        s = self.s
        limit = s.config.daemon.max_queued_per_uid
        if not is_privileged(caller, s.config.daemon.admin_group):
            mine = sum(
                1 for r in s.registry.clients() if r.uid == caller.uid and r.state is S.QUEUED
            )
            if mine >= limit:
                raise _fail(
                    E.NO_CAPACITY,
                    f"{why}; and {user_name(caller.uid)} already has {mine} jobs queued, the most "
                    f"one user may (daemon.max_queued_per_uid = {limit}): cancel one or wait",
                )
        where = gangplace.request_of(req, s.samples, self._resolve_gpu)  # --gpu, or a gang's
        rec = self._add_client(
            cls=cls, argv=req.argv, uid=caller.uid, gid=caller.gid, user=user_name(caller.uid),
            state=S.QUEUED, priority=s.priority(cls), name=req.name, gpu_request=where,
            sm_ceiling=req.sm_pct, mem_bytes=req.mem_bytes, restartable=req.restartable,
            checkpoint_signal=req.checkpoint_signal, detach=detach,
            env=req.env if detach else {}, cwd=req.cwd,
            pause_mechanism=s.pauser.mechanism.value,
        )  # fmt: skip
        if req.queue is not None or req.expected_s is not None:
            rec = s.registry.update(rec.id, queue=req.queue, expected_s=req.expected_s)
        if req.restart_cost_s is not None:  # issue 32
            rec = s.registry.update(rec.id, restart_cost_s=req.restart_cost_s)
        if not detach:
            self.loop.waiters.asked(rec.id, caller.pid, s.clock.monotonic())
        # Shown by status until the next admission round says why, in its own words.
        s.waiting = {**s.waiting, rec.id: why}
        log.info("client_queued", client_id=rec.id, uid=caller.uid, detach=detach, why=why)
        return self._queued_answer(rec)

    def _queued_answer(self, rec: ClientRecord) -> dict[str, Any]:
        s = self.s
        where = submitq.queue_positions(s.registry.clients(), s.clock.monotonic(), s.clock.time())
        result = protocol.SubmitResult(
            client_id=rec.id, gpu_uuid=None, state=S.QUEUED.value, env={},
            position=where.get(rec.id), waiting=s.waiting.get(rec.id),
        )  # fmt: skip
        return protocol.as_dict(result)

    def _wait_for(self, caller: Caller, client_id: str) -> dict[str, Any]:
        """A foreground submitter asks again: still queued, or adopted now with its environment."""
        s = self.s
        with s.lock:
            rec = self._get(client_id)
            if rec.uid != caller.uid or rec.detach:
                raise _fail(E.PERMISSION_DENIED, f"{client_id} is not a foreground job of yours")
            if rec.state is S.QUEUED:
                self.loop.waiters.asked(rec.id, caller.pid, s.clock.monotonic())
                return self._queued_answer(rec)
            if rec.state is not S.STARTING or rec.pid is not None or rec.gpu_uuid is None:
                raise _fail(E.CONFLICT, f"client {rec.id} is {rec.state.value}: {rec.reason}")
            sm = rec.sm_pct if rec.sm_pct is not None else s.default_sm(rec.cls, rec.gpu_uuid)
            env = self.life.mps_env(
                rec.id, rec.gpu_uuid, sm, rec.mem_bytes, rec.cls, None, queue=rec.queue,
                announce=True, gang=rec.gang,
            )  # fmt: skip
            rec = self._take_caller(rec.id, caller)
            self.loop.waiters.forget(rec.id)
            log.info("client_submitted", client_id=rec.id, cls=rec.cls.value, gpu=rec.gpu_uuid,
                     uid=caller.uid, detach=False, queued=True)  # fmt: skip
            result = protocol.SubmitResult(
                client_id=rec.id, gpu_uuid=rec.gpu_uuid, state=rec.state.value, env=env,
                pid=rec.pid, unset_env=list(mpsenv.UNSET_ENV),
            )  # fmt: skip
            return protocol.as_dict(result)

    def _check_submit(self, req: protocol.SubmitRequest, caller: Caller) -> ClientClass:
        try:
            cls = ClientClass(req.cls)
        except ValueError:
            raise _fail(E.INVALID_PARAMS, "cls must be 'online' or 'offline'") from None
        if req.gpus is not None and req.gpu != "any":
            raise _fail(E.INVALID_PARAMS, "--gpus names a gang's GPUs itself "
                        "(not with --gpu): --gpus 8 or --gpus 0,1")  # fmt: skip
        if not req.argv or not req.argv[0]:
            raise _fail(E.INVALID_PARAMS, "no command given: gpushare submit ... -- CMD ARGS")
        if any("\0" in a for a in req.argv):
            raise _fail(E.INVALID_PARAMS, "arguments must not contain NUL bytes")
        if req.sm_pct is not None and (problem := mpsenv.sm_pct_problem(req.sm_pct)) is not None:
            raise _fail(E.INVALID_PARAMS, problem)
        if req.mem_bytes is not None and req.mem_bytes < (1 << 20):
            raise _fail(E.INVALID_PARAMS, "--mem must be at least 1M")
        cost = req.restart_cost_s
        if cost is not None and not (
            isinstance(cost, int | float) and 0.0 <= cost <= protocol.MAX_RESTART_COST_S
        ):  # issue 32; NaN fails the comparison
            raise _fail(E.INVALID_PARAMS, "--restart-cost must be a duration from 0s to 168h")
        if cost is not None and cls is not ClientClass.OFFLINE:
            raise _fail(E.INVALID_PARAMS, "--restart-cost applies to --offline jobs")
        if req.slo_p99_ms is not None:
            if cls is not ClientClass.ONLINE:
                raise _fail(E.INVALID_PARAMS, "--slo-p99 applies to --online clients only")
            if not (req.slo_p99_ms > 0 and math.isfinite(req.slo_p99_ms)):
                raise _fail(E.INVALID_PARAMS, "--slo-p99 must be a positive duration")
        for flag, slo_ms in (("--slo-ttft-p99", req.slo_ttft_p99_ms),
                             ("--slo-tpot-p99", req.slo_tpot_p99_ms)):  # fmt: skip
            if slo_ms is not None and (problem := mpsenv.slo_problem(flag, cls, slo_ms / 1e3)):
                raise _fail(E.INVALID_PARAMS, problem)
        _check_online_source("--latency-from", req.latency_from, cls, self.s.latency.check_spec)
        _check_online_source("--inflight-from", req.inflight_from, cls, self.s.gauges.check_spec)
        if req.queue is not None:
            if cls is not ClientClass.OFFLINE:
                raise _fail(E.INVALID_PARAMS, "--queue applies to --offline clients only")
            if req.queue not in protocol.QUEUE_MODES:
                modes = ", ".join(protocol.QUEUE_MODES)
                raise _fail(E.INVALID_PARAMS, f"--queue must be one of {modes}, got {req.queue!r}")
        if req.restartable and cls is not ClientClass.OFFLINE:
            raise _fail(E.INVALID_PARAMS, "--restartable applies to --offline clients only")
        if not 1 <= req.checkpoint_signal < signal.NSIG:
            raise _fail(E.INVALID_PARAMS, f"no signal number {req.checkpoint_signal}")
        if req.name is not None and (len(req.name) > _MAX_NAME or not req.name.isprintable()):
            raise _fail(E.INVALID_PARAMS, f"--name must be printable, at most {_MAX_NAME} chars")
        if req.detach or req.restartable:
            if req.cwd is None or not req.cwd.startswith("/"):
                raise _fail(E.INVALID_PARAMS, "a detached submit needs an absolute cwd")
        elif caller.pid <= 0:
            # The workload is the connecting process itself (SO_PEERCRED, in the daemon's PID
            # namespace): the pid the CLI gives is its own namespace's and is not used.
            raise _fail(E.INVALID_PARAMS, "a foreground submit needs the caller's pid")
        return cls

    def _place(
        self, req: protocol.SubmitRequest, cls: ClientClass, uid: int
    ) -> tuple[GpuSample, float]:
        """The GPU a submit goes to and its SM share; refuses what does not fit."""
        if req.gpu == "any":
            shared = [g for g in self.s.samples if self.s.shared(g)]
            if not shared:
                raise _fail(E.UNAVAILABLE, "no shared GPU on this node (see [gpus] in the config)")
            candidates = self.cordon.admitting(shared)
        else:
            chosen = self._resolve_gpu(req.gpu)
            if not self.s.shared(chosen):
                raise _fail(
                    E.INVALID_PARAMS, f"GPU {req.gpu} is not shared by gpushare (gpus.shared)"
                )
            candidates = self.cordon.admitting([chosen], named=True)
        loads = self._loads(candidates)
        problems: list[str] = []
        fitting: list[tuple[GpuSample, float]] = []
        for g in candidates:
            why = self._misfit(g, loads[g.uuid], req, cls, uid)
            if why:
                problems.append(f"GPU {g.index}: {why}")
            else:
                sm = req.sm_pct if req.sm_pct is not None else self.s.default_sm(cls, g.uuid)
                fitting.append((g, sm))
        if not fitting:
            code = E.INVALID_PARAMS if any("--sm" in p for p in problems) else E.NO_CAPACITY
            if any("MPS is" in p for p in problems) and len(problems) == 1:
                code = E.UNAVAILABLE
            raise _fail(code, "; ".join(problems))
        # With several candidates: the most memory once promises are counted, then the fewest
        # clients (gpushare/control/placement.py): a burst of submits spreads over idle GPUs.
        best = placement.choose([loads[g.uuid] for g, _ in fitting])
        return next(f for f in fitting if f[0].uuid == best.uuid)

    def _place_gang(
        self, req: protocol.SubmitRequest, cls: ClientClass, uid: int
    ) -> tuple[Sequence[GpuSample], float]:
        """``--gpus``: the gang's GPUs in rank order, all or none (:mod:`.gangplace`), its share."""
        assert req.gpus is not None
        shared = [g for g in self.s.samples if self.s.shared(g)]
        n, named = gangplace.parse(req.gpus, shared, self._resolve_gpu)
        candidates = self.cordon.admitting(named or shared, named=named is not None)
        loads = self._loads(candidates)
        problems = [f"GPU {g.index}: draining" for g in named or () if g not in candidates]
        fits = {g.uuid: self._misfit(g, loads[g.uuid], req, cls, uid) for g in candidates}
        problems += [f"GPU {g.index}: {fits[g.uuid]}" for g in candidates if fits[g.uuid]]
        fitting = [g for g in candidates if not fits[g.uuid]]
        now, busy = self.s.clock.monotonic(), None  # an online gang (a TP server): D12
        if cls is ClientClass.OFFLINE:  # D14: the GPUs where the gang costs online services least
            busy = gangplace.services(self.s.registry.clients(), fitting,
                                      lambda u: self.s.gate.view(u, now))  # fmt: skip
        gpus = gangplace.choose(n, fitting, loads, problems, named is not None, busy)
        # The smallest share of its GPUs, as the queue's admission gives a gang (admission.py).
        sm = min(self.s.default_sm(cls, g.uuid) for g in gpus)
        return gpus, sm if req.sm_pct is None else req.sm_pct

    def _loads(self, gpus: Sequence[GpuSample]) -> dict[str, placement.GpuLoad]:
        """Each GPU's free memory, the memory promised to its clients, and its live clients."""
        now = self.s.clock.time()
        live: dict[str, list[ClientRecord]] = {g.uuid: [] for g in gpus}
        for r in self.s.registry.clients():
            for uuid in r.gpus() if r.state.is_live else ():
                if uuid in live:  # a gang counts on every GPU it uses
                    live[uuid].append(r)
        loads: dict[str, placement.GpuLoad] = {}
        for g in gpus:
            memory = {p.pid: p.used_bytes for p in g.processes}
            placed = [
                PlacedClient(r.mem_bytes, r.state, r.started_at, self._used(r, memory))
                for r in live[g.uuid]
                if r.mem_bytes is not None and may_promise(r.state, r.started_at, now)
            ]
            loads[g.uuid] = placement.GpuLoad(
                index=g.index, uuid=g.uuid, free_bytes=g.mem_free_bytes,
                promised_bytes=promised_bytes(placed, now), clients=len(live[g.uuid]),
            )  # fmt: skip
        return loads

    def _used(self, rec: ClientRecord, memory: dict[int, int | None]) -> int | None:
        """The GPU memory NVML attributes to a client's processes; None when it lists none."""
        if not memory or rec.pid is None:
            return None
        pids = {rec.pid}
        # Its children too (a launcher's workers hold the CUDA contexts), as the loop counts.
        with contextlib.suppress(*PAUSE_ERRORS):
            pids.update(self.s.pauser.pids(rec.id))
        known = [used for pid in pids if (used := memory.get(pid)) is not None]
        return sum(known) if known else None

    def _misfit(
        self,
        g: GpuSample,
        load: placement.GpuLoad,
        req: protocol.SubmitRequest,
        cls: ClientClass,
        uid: int,
    ) -> str:
        if g.lost:
            return fit.LOST
        if cls is ClientClass.OFFLINE and g.uuid in self.s.reserved:  # EASY backfill (D15)
            return f"reserved for the waiting gang {self.s.reserved[g.uuid]}"
        state = self.s.mps_states.get(g.uuid) or self.s.mps.state(g.uuid)
        if state in (MpsState.FAULT, MpsState.DOWN):
            return fit.mps_closed(state)
        gpu = self.s.config.for_gpu(g.index, g.uuid)
        top = gpu.offline_sm_pct_max
        if cls is ClientClass.OFFLINE and req.sm_pct is not None and req.sm_pct > top:
            return f"--sm {req.sm_pct:g} is above this GPU's offline maximum {top:g}"
        others = () if self.s.multiuser(g.uuid) else sorted(
            {r.user for r in self.s.registry.clients()
             if g.uuid in r.gpus() and r.state.is_live and r.uid != uid}
        )  # fmt: skip
        # The one fit rule (gpushare.control.fit), which admission asks too.
        room = fit.Room(
            closed=None, max_clients=gpu.max_clients,
            probe_slots=1 if self.s.config.probe.enabled else 0, live=load.clients,
            available_bytes=load.available_bytes, promised_bytes=load.promised_bytes,
            reserve_bytes=gpu.online_memory_reserve_bytes if cls is ClientClass.OFFLINE else 0,
            other_users=others,
        )  # fmt: skip
        why = fit.misfit(room, req.mem_bytes)
        if why is not None:
            return why
        if g.mem_total_bytes is not None and (req.mem_bytes or 0) > g.mem_total_bytes:
            return "--mem is larger than the GPU's memory"
        return ""
