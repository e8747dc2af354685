"""What ``status`` and ``list`` answer: the node's GPUs and clients as JSON-ready dicts.

Built under the state lock from the registry, the last samples and the controller's view; the
server encodes them outside it. The schema is docs/status-schema.md. Split from
:mod:`gpushare.daemon.api`, which checks requests and rights and calls :class:`Views`.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from gpushare import __version__, protocol, trust
from gpushare.control import pods
from gpushare.daemon.cordon import CordonApi
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.loop import ControlLoop
from gpushare.daemon.opstats import gate_status, latency_status, token_status
from gpushare.daemon.registry import ClientRecord
from gpushare.daemon.startcost import restart_cost_status
from gpushare.daemon.state import NodeState
from gpushare.daemon.submitq import queue_positions
from gpushare.latency.p99 import LatencyP99
from gpushare.latency.threads import threads_status
from gpushare.model import ClientClass, ClientState, GpuSample
from gpushare.node.procs.facts import process_cgroup

S = ClientState


def resolve_gpu(samples: Sequence[GpuSample], key: str) -> GpuSample:
    """The GPU an index or UUID names.

    Raises:
        ProtocolError: NOT_FOUND, naming the GPUs there are.
    """
    for g in samples:
        if key == g.uuid or (key.isascii() and key.isdigit() and int(key) == g.index):
            return g
    known = ", ".join(f"{g.index} ({g.uuid})" for g in samples) or "none"
    raise protocol.ProtocolError(
        protocol.ErrorCode.NOT_FOUND, f"no GPU {key!r} on this node; GPUs: {known}"
    )


class Views:
    """The ``status``, ``list`` and ``events`` answers of one daemon."""

    def __init__(
        self,
        state: NodeState,
        lifecycle: Lifecycle,
        loop: ControlLoop,
        started_mono: float,
        cordon: CordonApi,
    ) -> None:
        self.s = state
        self.cordon = cordon
        self.life = lifecycle
        self.loop = loop
        self._started_mono = started_mono
        self._cache_lock = threading.Lock()
        self._cache: dict[tuple[object, ...], tuple[object, dict[str, Any]]] = {}
        self._building: set[tuple[object, ...]] = set()

    def status(self, gpu: str | None, viewer: int = 0) -> dict[str, Any]:
        """``status``: GPUs and clients (schema in docs/status-schema.md).

        Built once per control tick and state of the registry, and shared by every caller asking
        the same, whoever it is (``viewer``, the caller's uid, changes nothing: what one user may
        not see of another's clients is taken out afterwards, by :func:`.rights.as_seen`, which
        also encodes each viewer's view once per answer); callers must not change it. 48 monitors
        polling at once then wait for one build under the state lock instead of 48, and users
        polling at once for one build instead of one each (bench/socket_load.py). A submit, a
        transition or any other change of a client record makes the next answer a new one at
        once; readings (gate, probe) are as of the tick.
        """
        del viewer  # the same answer for everyone (see above)
        return self._shared(("status", gpu), lambda: self._status(gpu))

    def _shared(
        self, key: tuple[object, ...], build: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        stamp = self._stamp()
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None and (hit[0] == stamp or key in self._building):
                # Fresh, or being rebuilt by another caller: the last answer (one build old)
                # rather than a queue of builds behind the state lock.
                return hit[1]
            self._building.add(key)
        try:
            answer = build()
        finally:
            with self._cache_lock:
                self._building.discard(key)
        with self._cache_lock:
            if len(self._cache) > 64:
                self._cache.clear()  # many GPUs x viewers: start again rather than grow
            self._cache[key] = (stamp, answer)
        return answer

    def _stamp(self) -> tuple[object, ...]:
        """What an answer depends on that can change between ticks: when it differs, rebuild.

        The tick (readings, duty), every live record (a new object on any change), the events
        written (a client added or ended), the clients held frozen and each GPU's request gate
        (both move at once on a request boundary, between ticks).
        """
        s, now = self.s, self.s.clock.monotonic()
        recs = s.registry.clients()
        gates = tuple((g.enabled, g.closed, g.inflight)
                      for g in (s.gate.view(x.uuid, now) for x in s.samples))  # fmt: skip
        return (
            self.loop.ticks, tuple(map(id, recs)), sum(s.registry.event_counts().values()),
            frozenset(self.life.paused), gates, tuple(self.cordon.view(x.uuid) for x in s.samples),
        )  # fmt: skip

    def _status(self, gpu: str | None) -> dict[str, Any]:
        s = self.s
        with s.lock:
            samples = list(s.samples)
            if gpu is not None:
                samples = [resolve_gpu(s.samples, gpu)]
            uuids = {x.uuid for x in samples}
            recs = [r for r in s.registry.clients() if not uuids.isdisjoint(r.gpus()) or (
                r.state is S.QUEUED and gpu is None)]  # fmt: skip
            by_uuid = {x.uuid: x for x in samples}
            now = s.clock.time()
            where = queue_positions(recs, s.clock.monotonic(), now)
            clients = [
                self._client_dict(r, by_uuid.get(r.gpu_uuid or ""), now, where) for r in recs
            ]
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
                    "simulated": s.gpu.simulated,
                    # Request-boundary datagrams and gauge polls refused, by reason.
                    "inflight_rejections": s.gate.rejections.snapshot(),
                    **threads_status(s.threads, s.datagram_drops()),
                    # Uses of a file refused by gpushare.trust (not root's), by the file's role.
                    "trust_refusals": trust.refusals(),
                    # Where workloads reach this daemon (gpushare env uses these, not its own
                    # config: the daemon asked may run with another one).
                    "paths": {
                        "mps_pipe_dir": str(s.config.paths.resolved("mps_pipe_dir")),
                        "latency_socket": str(s.config.paths.resolved("latency_socket")),
                    },
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
        # A gang counts on every GPU it uses (its rank there is one MPS client).
        live = [r for r in recs if x.uuid in r.gpus() and r.state.is_live]
        probe_on = s.config.probe.enabled and shared
        reading = s.probe.reading(x.uuid) if s.probe is not None and shared else None
        mps_state = s.mps_states.get(x.uuid)
        online = [r for r in live if r.cls is ClientClass.ONLINE]
        ratio = reading.ratio if reading is not None else None
        # App-reported p99 against each declared SLO first; the probe speaks for the rest.
        app = [(r, s.p99.get(r.id)) for r in online if r.slo_p99_ms is not None]
        known = [(r, p.p99_ms) for r, p in app if p is not None and p.p99_ms is not None]
        violated = [r.id for r, p99 in known if p99 > (r.slo_p99_ms or math.inf)]
        # An LLM server's TTFT and TPOT p99s against their SLOs, as the controller reads them.
        tokens = [(r, _token_over(r, s.p99.get(r.id))) for r in online if _has_token_slo(r)]
        known += [(r, 0.0) for r, over in tokens if over is not None and r.id not in violated]
        violated += [r.id for r, over in tokens if over and r.id not in violated]
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
            "mps_backend": s.mps.backend,
            "duty": s.duty.get(x.uuid, 1.0),
            "gate": gate_status(
                s.duty.get(x.uuid, 1.0), s.ops.last_action(x.uuid), self.s.clock.monotonic()
            )
            if shared
            else None,
            "offline_sm_pct": s.default_sm(ClientClass.OFFLINE, x.uuid),
            "offline_mps_priority": s.priority(ClientClass.OFFLINE, (x.uuid,)),
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
            "clients": [r.id for r in live],
            "client_slots_max": s.max_clients(x),
            "error": x.error,
            "lost": x.lost,
            "drain": self.cordon.view(x.uuid),
        }

    def _gang(self, r: ClientRecord) -> list[dict[str, Any]]:
        """Every GPU the client uses, in rank order (a one-GPU client's one; none while queued)."""
        index = {x.uuid: x.index for x in self.s.samples}
        return [{"rank": k, "uuid": u, "index": index.get(u)} for k, u in enumerate(r.gpus())]

    def _client_dict(
        self, r: ClientRecord, sample: GpuSample | None, now: float, where: dict[str, int]
    ) -> dict[str, Any]:
        used = None
        if sample is not None and r.pid is not None:
            used = next((p.used_bytes for p in sample.processes if p.pid == r.pid), None)
        latency = offline = None
        if r.cls is ClientClass.ONLINE and r.state.is_live:
            latency = self._latency(r)
        elif r.cls is ClientClass.OFFLINE:
            offline = self.s.ops.offline_fields(r.id, r.state, self.s.clock.monotonic())
            # What the submitter asked (null: model.DEFAULT_QUEUE_MODE) and, while it runs, the queue it has and how
            # a shallow one is kept ("4 in flight", "blocking").
            shallow = self.life.shallow.get(r.id) if r.state.is_live else None
            now_q = None if not r.state.is_live else "shallow" if shallow else "deep"
            offline["queue"] = {"asked": r.queue, "now": now_q, "shallow": shallow}
            offline["restart_cost"] = restart_cost_status(r, self.s.config.control)
        uptime = None
        if r.started_at is not None and r.state.is_live:
            uptime = round(now - r.started_at, 3)
        # The last admission round's reason (the loop writes it under the same lock); none
        # before the first round that saw the job.
        waiting = self.s.waiting.get(r.id) if r.state is S.QUEUED else None
        return {
            "id": r.id, "name": r.name, "user": r.user, "uid": r.uid, "class": r.cls.value,
            "gpu_uuid": r.gpu_uuid, "gpu_index": r.gpu_index, "gpus": self._gang(r),
            "sm_pct": r.sm_pct,
            "mem_limit_bytes": r.mem_bytes, "mem_used_bytes": used, "state": r.state.value,
            "reason": r.reason, "waiting": waiting, "pid": r.pid, "uptime_s": uptime,
            "exit_code": r.exit_code, "pause_mechanism": r.pause_mechanism, "held": r.held, "restartable": r.restartable,
            "detached": r.detach, "slo_p99_ms": r.slo_p99_ms, "argv": list(r.argv),
            "slo_ttft_p99_ms": r.slo_ttft_p99_ms, "slo_tpot_p99_ms": r.slo_tpot_p99_ms,
            "log_path": r.log_path, "restarts": r.restarts, "submitted_at": r.submitted_at,
            "latency": latency, "offline": offline,
            "started_at": r.started_at, "ended_at": r.ended_at,
            "adopted_by": r.adopted_by, "pause_reason": self._pause_reason(r),
            "container": self._container(r),
            # Queued: its place in the queue (1 is tried first) and its declared length.
            "queue_position": where.get(r.id), "expected_s": r.expected_s,
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
        found = self.s.pauser.route(r.id) if r.adopted_by is not None else None
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
        p99 = s.p99.get(r.id)
        lat = s.config.latency
        out["ttft"] = token_status(p99.ttft if p99 else None, r.slo_ttft_p99_ms, lat.ttft_window_s)
        out["tpot"] = token_status(p99.tpot if p99 else None, r.slo_tpot_p99_ms, lat.tpot_window_s)
        return out

    def clients(self, *, include_final: bool, viewer: int = 0) -> dict[str, Any]:
        """``list``: clients (live and queued, or all); shared as :meth:`status` is."""
        del viewer  # the same answer for everyone (see status)
        return self._shared(("list", include_final), lambda: self._clients(include_final))

    def events(self, since_id: int, limit: int) -> dict[str, Any]:
        """``events``: at most ``limit`` events of the log after ``since_id``."""
        events = self.s.registry.events(since_id, limit)
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
            "last_id": events[-1].id if events else max(since_id, 0),
        }

    def _clients(self, include_final: bool) -> dict[str, Any]:
        with self.s.lock:
            by_uuid = {s.uuid: s for s in self.s.samples}
            now = self.s.clock.time()
            recs = self.s.registry.clients(include_final=include_final)
            where = queue_positions(recs, self.s.clock.monotonic(), now)
            return {
                "schema_version": protocol.LIST_SCHEMA_VERSION,
                "clients": [
                    self._client_dict(r, by_uuid.get(r.gpu_uuid or ""), now, where) for r in recs
                ],
            }


def _has_token_slo(r: ClientRecord) -> bool:
    return r.slo_ttft_p99_ms is not None or r.slo_tpot_p99_ms is not None


def _token_over(r: ClientRecord, p99: LatencyP99 | None) -> bool | None:
    """Whether an LLM server's TTFT or TPOT p99 is over its SLO; ``None``: neither known yet."""
    pairs = [
        (p99.ttft if p99 is not None else None, r.slo_ttft_p99_ms),
        (p99.tpot if p99 is not None else None, r.slo_tpot_p99_ms),
    ]
    known = [(got.p99_ms, slo) for got, slo in pairs if got and got.p99_ms is not None and slo]
    if not known:
        return None
    return any(value > slo for value, slo in known)
