"""The daemon's API: request handlers, their checks, and who may act on which client.

:class:`Api` answers the requests of :mod:`gpushare.protocol` on the server's threads: ``status``,
``list`` and ``events`` read the node; ``submit`` checks a request against the node, places it on a
GPU and hands it to the :class:`~gpushare.daemon.lifecycle.Lifecycle`; ``cancel``, ``pause`` and
``resume`` act on a client after checking that the caller owns it (or is root or an admin). A bad
request gets a :class:`~gpushare.protocol.ProtocolError` that names the fix and changes nothing.
"""

from __future__ import annotations

import contextlib
import grp
import math
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from gpushare import __version__, mpsenv, pods, protocol
from gpushare.control.promise import PlacedClient, may_promise, promised_bytes
from gpushare.daemon import placement
from gpushare.daemon.adopter import Adoptions
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.loop import ControlLoop
from gpushare.daemon.opstats import gate_status, latency_status
from gpushare.daemon.registry import ClientRecord
from gpushare.daemon.server import Caller
from gpushare.daemon.state import PAUSE_ERRORS, RUNNING_STATES, NodeState
from gpushare.inflight import parse_inflight_from
from gpushare.latency.prometheus import parse_latency_from
from gpushare.model import ClientClass, ClientState, GpuSample, MpsState
from gpushare.node.procs.facts import process_cgroup
from gpushare.node.procs.identity import process_start_time
from gpushare.node.procs.users import user_in_group, user_name
from gpushare.units import format_size

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
        self._started_mono = state.clock.monotonic()

    def methods(self) -> dict[str, Handler]:
        """The explicit dispatch table of the API (``hello`` is answered by the server)."""
        return {
            protocol.STATUS: self.status,
            protocol.LIST: self.list,
            protocol.EVENTS: self.events,
            protocol.SUBMIT: self.submit,
            protocol.CANCEL: self.cancel,
            protocol.PAUSE: self.pause,
            protocol.RESUME: self.resume,
            protocol.ADOPT: self.adopt,
            protocol.RELEASE: self.release,
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
        """``status``: GPUs and clients (schema in docs/status-schema.md)."""
        req = protocol.from_params(protocol.StatusRequest, params)
        s = self.s
        with s.lock:
            samples = list(s.samples)
            if req.gpu is not None:
                samples = [self._resolve_gpu(req.gpu)]
            uuids = {x.uuid for x in samples}
            recs = [r for r in s.registry.clients() if r.gpu_uuid in uuids or (
                r.state is S.QUEUED and req.gpu is None)]  # fmt: skip
            by_uuid = {x.uuid: x for x in samples}
            now = s.clock.time()
            clients = [self._client_dict(r, by_uuid.get(r.gpu_uuid or ""), now) for r in recs]
            gpus = [self._gpu_dict(x, recs) for x in samples]
            return {
                "schema_version": protocol.STATUS_SCHEMA_VERSION,
                "daemon": {
                    "version": __version__,
                    "pid": os.getpid(),
                    "uptime_s": round(s.clock.monotonic() - self._started_mono, 3),
                    "ready": self.loop.ready,
                    "policy": s.policy.name,
                    "pause_mechanism": s.pauser.mechanism.value,
                    "summary": self.loop.summary(),
                    # Optional attributes of the adapters: only the simulated node sets them.
                    "simulated": bool(getattr(s.gpu, "simulated", False)),
                    # Request-boundary datagrams and gauge polls refused, by reason.
                    "inflight_rejections": s.gate.rejections.snapshot(),
                },
                "gpus": gpus,
                "clients": clients,
            }

    def _gate_dict(self, gpu_uuid: str) -> dict[str, Any]:
        g = self.s.gate.view(gpu_uuid, self.s.clock.monotonic())
        return {
            "enabled": g.enabled,
            "closed": g.closed,
            "inflight": g.inflight,
            "signalled_clients": g.signalled_clients,
            "busy_fraction": g.busy_fraction,
            "closes": g.closes,
            "delay_ms": round(g.delay_s * 1000.0, 3),
        }

    def _gpu_dict(self, x: GpuSample, recs: Sequence[ClientRecord]) -> dict[str, Any]:
        s = self.s
        shared = s.shared(x)
        live = [r for r in recs if r.gpu_uuid == x.uuid and r.state.is_live]
        probe_on = s.config.probe.enabled and shared
        reading = s.probe.reading(x.uuid) if s.probe is not None and shared else None
        mps_state = s.mps_states.get(x.uuid)
        online = [r for r in live if r.cls is ClientClass.ONLINE]
        ratio = reading.ratio if reading is not None else None
        # App-reported p99 against each declared SLO first; the probe speaks for the rest.
        app = [(r, s.p99.get(r.id)) for r in online if r.slo_p99_ms is not None]
        known = [(r, p.p99_ms) for r, p in app if p is not None and p.p99_ms is not None]
        violated = [r.id for r, p99 in known if p99 > (r.slo_p99_ms or math.inf)]
        # The probe stands in only for online clients whose own p99 is unknown: it is no request,
        # and with request gating it meets offline work between requests by design, so it reads
        # high while every request is well inside its SLO (the controller does not follow it then
        # either). A client's own p99 against its own SLO is the verdict where there is one.
        judged = {r.id for r, _ in known}
        probe_counts = any(r.id not in judged for r in online)
        slo: dict[str, Any] = {"probe_ratio": ratio, "violating_clients": violated, "reason": None}
        if not online:
            slo["state"] = "no_online_clients"
        elif violated or (
            probe_counts and ratio is not None and ratio > s.config.control.probe_slo_ratio
        ):
            slo["state"] = "degraded"
        elif known or ratio is not None:
            slo["state"] = "ok"
        else:
            slo["state"] = "unknown"
            slo["reason"] = reading.reason if reading is not None else "probe disabled"
        return {
            "index": x.index,
            "uuid": x.uuid,
            "name": x.name,
            "shared": shared,
            "mem_total_bytes": x.mem_total_bytes,
            "mem_used_bytes": x.mem_used_bytes,
            "mem_free_bytes": x.mem_free_bytes,
            "mem_reserve_bytes": s.reserve(x),
            "gpu_util_pct": x.gpu_util_pct,
            "sm_active_pct": x.sm_active_pct,
            "mps_state": mps_state.value if mps_state is not None else None,
            "mps_backend": getattr(s.mps, "backend", None),
            "duty": s.duty.get(x.uuid, 1.0),
            "gate": gate_status(
                s.duty.get(x.uuid, 1.0), s.ops.last_action(x.uuid), self.s.clock.monotonic()
            )
            if shared
            else None,
            "offline_sm_pct": s.default_sm(ClientClass.OFFLINE, x.uuid),
            "request_gate": self._gate_dict(x.uuid) if shared else None,
            "online_slo": slo,
            "probe": {
                "enabled": probe_on,
                "latency_ms": reading.latency_ms if reading else None,
                "baseline_ms": reading.baseline_ms if reading else None,
                "ratio": reading.ratio if reading else None,
                "reason": reading.reason if reading else "probe disabled",
            },
            "client_slots_used": len(live) + (1 if probe_on else 0),
            "client_slots_max": s.max_clients(x),
            "error": x.error,
            "lost": x.lost,
        }

    def _client_dict(self, r: ClientRecord, sample: GpuSample | None, now: float) -> dict[str, Any]:
        used = None
        if sample is not None and r.pid is not None:
            used = next((p.used_bytes for p in sample.processes if p.pid == r.pid), None)
        latency = offline = None
        if r.cls is ClientClass.ONLINE and r.state.is_live:
            latency = self._latency(r)
        elif r.cls is ClientClass.OFFLINE:
            offline = self.s.ops.offline_fields(r.id, r.state, self.s.clock.monotonic())
            # What the submitter asked (null: deep) and, while it runs, the queue it has and how
            # a shallow one is kept ("4 in flight", "blocking").
            shallow = self.life.shallow.get(r.id) if r.state.is_live else None
            now_q = None if not r.state.is_live else "shallow" if shallow else "deep"
            offline["queue"] = {"asked": r.queue, "now": now_q, "shallow": shallow}
        uptime = None
        if r.started_at is not None and r.state.is_live:
            uptime = round(now - r.started_at, 3)
        # The last admission round's reason (the loop writes it under the same lock); none
        # before the first round that saw the job.
        waiting = self.s.waiting.get(r.id) if r.state is S.QUEUED else None
        return {
            "id": r.id, "name": r.name, "user": r.user, "uid": r.uid, "class": r.cls.value,
            "gpu_uuid": r.gpu_uuid, "gpu_index": r.gpu_index, "sm_pct": r.sm_pct,
            "mem_limit_bytes": r.mem_bytes, "mem_used_bytes": used, "state": r.state.value,
            "reason": r.reason, "waiting": waiting, "pid": r.pid, "uptime_s": uptime,
            "exit_code": r.exit_code, "pause_mechanism": r.pause_mechanism, "held": r.held, "restartable": r.restartable,
            "detached": r.detach, "slo_p99_ms": r.slo_p99_ms, "argv": list(r.argv),
            "log_path": r.log_path, "restarts": r.restarts, "submitted_at": r.submitted_at,
            "latency": latency, "offline": offline,
            "started_at": r.started_at, "ended_at": r.ended_at,
            "adopted_by": r.adopted_by, "pause_reason": self._pause_reason(r),
            "container": self._container(r),
        }  # fmt: skip

    @staticmethod
    def _container(r: ClientRecord) -> dict[str, Any] | None:
        # An adopted process's container and Kubernetes pod, named by its cgroup path.
        if r.adopted_by is None or r.pid is None or not r.state.is_live:
            return None
        found = pods.container_of_cgroup(process_cgroup(r.pid) or "/")
        if found is None:
            return None
        return {"id": found.container_id, "runtime": found.runtime or None,
                "pod_uid": found.pod_uid, "qos": found.qos}  # fmt: skip

    def _pause_reason(self, r: ClientRecord) -> str | None:
        # How an adopted client is paused where it is, and why that way (None: launched).
        route = getattr(self.s.pauser, "route", None)
        found = route(r.id) if r.adopted_by is not None and callable(route) else None
        return found.reason if found is not None else None

    def _latency(self, r: ClientRecord) -> dict[str, Any]:
        s = self.s
        reading = None
        if s.probe is not None and r.gpu_uuid is not None:
            reading = s.probe.reading(r.gpu_uuid)  # as online_slo reads it
        out = latency_status(
            s.p99.get(r.id),
            r.slo_p99_ms,
            reading.ratio if reading is not None else None,
            s.config.control.probe_slo_ratio,
        )
        out["window_s"] = s.config.latency.window_s
        return out

    def list(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``list``: clients (live and queued, or all)."""
        req = protocol.from_params(protocol.ListRequest, params)
        with self.s.lock:
            by_uuid = {s.uuid: s for s in self.s.samples}
            now = self.s.clock.time()
            recs = self.s.registry.clients(include_final=req.all)
            return {
                "clients": [self._client_dict(r, by_uuid.get(r.gpu_uuid or ""), now) for r in recs]
            }

    def events(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``events``: the event log after ``since_id``."""
        req = protocol.from_params(protocol.EventsRequest, params)
        if req.since_id < 0 or not 1 <= req.limit <= 10_000:
            raise _fail(E.INVALID_PARAMS, "since_id must be >= 0 and limit in 1..10000")
        events = self.s.registry.events(req.since_id, req.limit)
        return {
            "events": [
                {
                    "id": e.id,
                    "at": e.at,
                    "kind": e.kind,
                    "severity": e.severity,
                    "client_id": e.client_id,
                    "gpu_uuid": e.gpu_uuid,
                    "message": e.message,
                }
                for e in events
            ],  # fmt: skip
            "last_id": events[-1].id if events else max(req.since_id, 0),
        }

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
        return self._adoptions().register(caller.uid, params)

    def release(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``release``: end a job's registration and its clients (thawed, not killed)."""
        return self._adoptions().release(caller.uid, params)

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
        for g in self.s.samples:
            if key == g.uuid or (key.isdigit() and int(key) == g.index):
                return g
        known = ", ".join(f"{g.index} ({g.uuid})" for g in self.s.samples) or "none"
        raise _fail(E.NOT_FOUND, f"no GPU {key!r} on this node; GPUs: {known}")

    def submit(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        """``submit``: validate against the node, register, and adopt (foreground) or spawn."""
        req = protocol.from_params(protocol.SubmitRequest, params)
        cls = self._check_submit(req, caller)
        detach = req.detach or req.restartable
        with self.s.lock:
            sample, sm = self._place(req, cls, caller.uid)
            rec = self.s.registry.add_client(
                cls=cls, argv=req.argv, uid=caller.uid, gid=caller.gid,
                user=user_name(caller.uid), state=S.STARTING, priority=self.s.priority(cls),
                name=req.name, gpu_request=req.gpu, gpu_uuid=sample.uuid, gpu_index=sample.index,
                sm_ceiling=req.sm_pct, sm_pct=sm,
                mem_bytes=req.mem_bytes, slo_p99_ms=req.slo_p99_ms, restartable=req.restartable,
                checkpoint_signal=req.checkpoint_signal, detach=detach,
                env=req.env if detach else {}, cwd=req.cwd,
                pause_mechanism=self.s.pauser.mechanism.value,
            )  # fmt: skip
            if req.latency_from is not None:
                self.s.registry.update(rec.id, latency_from=req.latency_from)
                self.s.latency.add_prometheus(rec.id, req.latency_from)
            if req.inflight_from is not None or req.queue is not None:
                rec = self.s.registry.update(
                    rec.id, inflight_from=req.inflight_from, queue=req.queue
                )
            if req.inflight_from is not None:
                self.s.gauges.add(rec.id, req.inflight_from)
            # Detached, spawn() computes the environment again for the launch and logs the queue.
            env = self.life.mps_env(
                rec.id, sample.uuid, sm, req.mem_bytes, cls, req.slo_p99_ms,
                queue=req.queue, announce=not detach,
            )  # fmt: skip
            if not detach:
                assert caller.pid > 0
                start_time = process_start_time(caller.pid)
                rec = self.life.adopt_foreground(
                    rec.id, caller.pid, start_time, owner_uid=caller.uid
                )
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

    def _check_submit(self, req: protocol.SubmitRequest, caller: Caller) -> ClientClass:
        try:
            cls = ClientClass(req.cls)
        except ValueError:
            raise _fail(E.INVALID_PARAMS, "cls must be 'online' or 'offline'") from None
        if not req.argv or not req.argv[0]:
            raise _fail(E.INVALID_PARAMS, "no command given: gpushare submit ... -- CMD ARGS")
        if any("\0" in a for a in req.argv):
            raise _fail(E.INVALID_PARAMS, "arguments must not contain NUL bytes")
        if req.sm_pct is not None and not (0 < req.sm_pct <= 100 and math.isfinite(req.sm_pct)):
            raise _fail(E.INVALID_PARAMS, f"--sm must be in (0, 100], got {req.sm_pct:g}")
        if req.mem_bytes is not None and req.mem_bytes < (1 << 20):
            raise _fail(E.INVALID_PARAMS, "--mem must be at least 1M")
        if req.slo_p99_ms is not None:
            if cls is not ClientClass.ONLINE:
                raise _fail(E.INVALID_PARAMS, "--slo-p99 applies to --online clients only")
            if not (req.slo_p99_ms > 0 and math.isfinite(req.slo_p99_ms)):
                raise _fail(E.INVALID_PARAMS, "--slo-p99 must be a positive duration")
        _check_online_source("--latency-from", req.latency_from, cls, parse_latency_from)
        _check_online_source("--inflight-from", req.inflight_from, cls, parse_inflight_from)
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
        elif req.pid != caller.pid:
            raise _fail(
                E.INVALID_PARAMS,
                "a foreground submit must come from the process that will exec the workload "
                f"(pid {req.pid} given, the connection is pid {caller.pid})",
            )
        return cls

    def _place(
        self, req: protocol.SubmitRequest, cls: ClientClass, uid: int
    ) -> tuple[GpuSample, float]:
        """The GPU a submit goes to and its SM share; refuses what does not fit."""
        if req.gpu == "any":
            candidates = [g for g in self.s.samples if self.s.shared(g)]
            if not candidates:
                raise _fail(E.UNAVAILABLE, "no shared GPU on this node (see [gpus] in the config)")
        else:
            chosen = self._resolve_gpu(req.gpu)
            if not self.s.shared(chosen):
                raise _fail(
                    E.INVALID_PARAMS, f"GPU {req.gpu} is not shared by gpushare (gpus.shared)"
                )
            candidates = [chosen]
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
        # clients (gpushare/daemon/placement.py): a burst of submits spreads over idle GPUs.
        best = placement.choose([loads[g.uuid] for g, _ in fitting])
        return next(f for f in fitting if f[0].uuid == best.uuid)

    def _loads(self, gpus: Sequence[GpuSample]) -> dict[str, placement.GpuLoad]:
        """Each GPU's free memory, the memory promised to its clients, and its live clients."""
        now = self.s.clock.time()
        live: dict[str, list[ClientRecord]] = {g.uuid: [] for g in gpus}
        for r in self.s.registry.clients():
            if r.state.is_live and r.gpu_uuid in live:
                live[r.gpu_uuid].append(r)
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
            return "the GPU is lost (see gpushare events)"
        state = self.s.mps_states.get(g.uuid) or self.s.mps.state(g.uuid)
        if state in (MpsState.FAULT, MpsState.DOWN):
            return f"MPS is {state.value} (see gpushare events)"
        override = self.s.config.gpu_override(g.index, g.uuid)
        top = override.offline_sm_pct_max or self.s.config.control.offline_sm_pct_max
        if cls is ClientClass.OFFLINE and req.sm_pct is not None and req.sm_pct > top:
            return f"--sm {req.sm_pct:g} is above this GPU's offline maximum {top:g}"
        live = load.clients
        probe = 1 if self.s.config.probe.enabled else 0
        if live + probe + 1 > self.s.max_clients(g):
            return (
                f"all {self.s.max_clients(g)} MPS client slots are taken ({live} clients"
                + (" + the latency probe" if probe else "")
                + ")"
            )
        if not self.s.multiuser(g.uuid):
            others = sorted({r.user for r in self.s.registry.clients()
                             if r.gpu_uuid == g.uuid and r.state.is_live and r.uid != uid})  # fmt: skip
            if others:
                return (
                    f"MPS serves one user at a time here and {', '.join(others)} has clients "
                    "running (docs/design.md D11): pick another GPU, wait, or set mps.multiuser"
                )
        free = load.available_bytes
        reserve = self.s.reserve(g) if cls is ClientClass.OFFLINE else 0
        need = (req.mem_bytes or 0) + reserve
        if free is not None and need > free:
            kept = f" with {format_size(reserve)} kept for online clients" if reserve else ""
            promised = (
                f" after {format_size(load.promised_bytes)} promised to clients that do not use "
                "their --mem yet"
                if load.promised_bytes
                else ""
            )
            return f"needs {format_size(need)}{kept}, {format_size(max(0, free))} free{promised}"
        if g.mem_total_bytes is not None and (req.mem_bytes or 0) > g.mem_total_bytes:
            return "--mem is larger than the GPU's memory"
        return ""
