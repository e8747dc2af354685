"""What the daemon knows right now, shared by its API, its client lifecycle and its control loop.

One :class:`NodeState` holds the config, the registry, the node adapters (clock and processes
included, so the same code runs on a host and in the simulator's virtual time), the policy, the last
readings (GPU samples, app p99s, MPS states) and the two levers every part reads (each GPU's
offline duty and offline SM share) and the request gates, with the lookups derived from them. Every change of state goes
through :attr:`NodeState.lock`, so the loop, the API handlers and the exit watcher never interleave
inside a transition.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from gpushare.config import Config
from gpushare.control.gpu_state import GpuState
from gpushare.control.policy import Policy
from gpushare.daemon.cordon import FILE_NAME as CORDON_FILE
from gpushare.daemon.cordon import Cordons
from gpushare.daemon.freeze import FreezeArbiter
from gpushare.daemon.gating import Gatekeeper
from gpushare.daemon.inflight_control import BoundWriter
from gpushare.daemon.opstats import OpStats
from gpushare.daemon.registry import ClientRecord, Registry, TransitionError
from gpushare.latency.app import AppLatency
from gpushare.latency.inflight import GaugePoller
from gpushare.latency.p99 import LatencyP99, TokenTrackers
from gpushare.latency.threads import Supervisor
from gpushare.model import Action, ClientClass, ClientState, GpuSample, MpsState, Observation
from gpushare.node.base import (
    Clock,
    DaemonGpuBackend,
    DaemonMpsNode,
    LatencyProbe,
    NodePauser,
    ProcessHost,
)
from gpushare.node.pauser_base import PauserError

log = structlog.get_logger(__name__)

S = ClientState
RUNNING_STATES = frozenset({S.RUNNING, S.THROTTLED, S.FROZEN})
"""States of a client whose process runs (possibly frozen)."""
PAUSE_ERRORS = (OSError, PauserError)
"""A pauser fails with OSError (cgroupfs, signals) or its own PauserError (timeouts, no cgroup)."""


class NoopPolicy:
    """A policy that never acts: offline work runs unthrottled. Used until a controller is wired."""

    name = "none"
    offline_mps_priority = ClientClass.OFFLINE.mps_priority
    gpu_mode = "mps"
    preemption = None

    def initial_state(self, gpu_uuid: str, now: float) -> None:
        """No state."""
        return None

    def step(self, state: None, observation: Observation, now: float) -> tuple[None, list[Action]]:
        """No actions."""
        return None, []


class NodeState:
    """The daemon's shared state: config, registry, adapters, policy, readings and levers."""

    def __init__(
        self,
        config: Config,
        *,
        registry: Registry,
        gpu: DaemonGpuBackend,
        mps: DaemonMpsNode,
        pauser: NodePauser,
        probe: LatencyProbe | None,
        policy: Policy[Any] | None,
        clock: Clock,
        procs: ProcessHost,
        shallow_library: str | None,
        library_vet: Callable[[str], str | None] | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.gpu = gpu
        self.mps = mps
        self.pauser = pauser
        self.probe = probe
        #: The time the loop runs on and the clients' processes: the host's, or simulated ones.
        self.clock = clock
        self.procs = procs
        #: The in-flight library shallow queues preload; None: they block (``launcher.queue_env``).
        self.shallow_library = shallow_library
        #: Asked at each launch whether the library may be preloaded now (``gpushare.trust``); a
        #: simulated node preloads nothing, so it has none.
        self.library_vet = library_vet
        #: Issue 32: where live ``--queue auto`` clients' in-flight bound is written
        #: (``gpushare.daemon.inflight_control``); ``None``: no live switch, auto restarts.
        self.bound_writer: BoundWriter | None = None
        self.policy: Policy[Any] = policy if policy is not None else NoopPolicy()
        #: The receiver and poller threads, restarted when they die (``status`` shows them).
        self.threads = Supervisor()
        #: Latency datagrams dropped, by reason (the daemon's receiver sets it when it starts).
        self.datagram_drops: Callable[[], dict[str, int]] = dict
        lat = config.latency
        tokens = TokenTrackers(
            lat.min_samples, ttft_window_s=lat.ttft_window_s,
            ttft_max_samples=lat.ttft_max_samples, tpot_window_s=lat.tpot_window_s,
            tpot_max_samples=lat.tpot_max_samples,
        )  # fmt: skip
        self.latency = AppLatency(
            lat.window_s, lat.min_samples, lat.scrape_period_s, threads=self.threads, tokens=tokens
        )
        #: Why each client is frozen (duty, holds, gates, the stop): every freeze goes through it.
        self.freeze = FreezeArbiter(pauser, clock=clock.monotonic, on_edge=self._paused_edge)
        #: Request gating (its freezes go through the arbiter).
        self.gate = Gatekeeper(
            config.gate, pauser, online_gpu=self._online_gpu, clock=clock.monotonic,
            arbiter=self.freeze,
        )  # fmt: skip
        #: The --inflight-from gauges, polled into the gates.
        self.gauges = GaugePoller(
            config.gate.gauge_period_s, self.gate.on_gauge, self.gate.rejections,
            threads=self.threads,
        )  # fmt: skip
        self.lock = threading.RLock()
        #: The last tick's readings.
        self.samples: list[GpuSample] = []
        self.p99: dict[str, LatencyP99] = {}
        self.mps_states: dict[str, MpsState] = {}
        #: The levers the controller sets per GPU (absent: 1.0 and the configured defaults).
        self.duty: dict[str, float] = {}
        #: ``SetOfflinePriority``'s; not kept: a restarted daemon has seen nothing to choose 0 on.
        self.offline_priority: dict[str, int] = {}
        # Kept (issue 27): clients running after a daemon restart started with it, not a default.
        self.offline_share: dict[str, float] = _kept_shares(registry.setting(_SHARE_SETTING))
        #: Why each queued job was not started at the last admission round, by client id
        #: (``status``/``list``'s ``waiting``), replaced every round: never more than the queue.
        self.waiting: dict[str, str] = {}
        #: GPUs a waiting gang reserved at the last round (docs/design.md D15): UUID -> its id.
        self.reserved: dict[str, str] = {}
        self._shared: dict[tuple[int, str], bool] = {}
        self._shared_for: Config | None = None
        #: Thawed time, evictions, step timings and each GPU's last action, for status and metrics.
        self.ops = OpStats()
        #: GPUs that admit nothing new (``gpushare drain``), kept in the state directory.
        self.cordons = Cordons(config.paths.state_dir / CORDON_FILE)

    def _online_gpu(self, client_id: str) -> str | None:
        """The GPU of a live online client (the gates ask for one the last tick did not list)."""
        rec = self.registry.find(client_id)
        if rec is None or rec.cls is not ClientClass.ONLINE or not rec.state.is_live:
            return None
        return rec.gpu_uuid

    def transition(self, client_id: str, to: ClientState, **kw: Any) -> ClientRecord | None:
        """Move a client in the registry; a refused move is logged and gives None."""
        try:
            return self.registry.transition(client_id, to, **kw)
        except TransitionError as exc:
            log.warning("transition_refused", client_id=client_id, to=to.value, error=str(exc))
            return None

    def set_offline_share(self, gpu_uuid: str, sm_pct: float) -> None:
        """Set a GPU's offline share and keep it across daemon restarts."""
        self.offline_share[gpu_uuid] = sm_pct
        self.registry.keep_setting(_SHARE_SETTING, self.offline_share)

    def initial_policy_state(self, gpu_uuid: str, now: float) -> Any:
        """The policy's state for a GPU it has not seen, with the offline share kept from before."""
        state = self.policy.initial_state(gpu_uuid, now)
        kept = self.offline_share.get(gpu_uuid)
        if kept is not None and isinstance(state, GpuState):
            state = dataclasses.replace(state, share_pct=kept)
        return state

    def _paused_edge(self, client_ids: Sequence[str], frozen: bool, now: float) -> None:
        for client_id in client_ids:
            self.ops.paused(client_id, frozen, now)

    def multiuser(self, gpu_uuid: str) -> bool:
        """Whether the GPU's MPS serves several users at once (docs/design.md D11)."""
        # Only the real MPS node knows whether its daemon runs -multiuser-server; without that
        # knowledge (no supervisor: simulated, fakes) assume the stricter legacy behaviour.
        supervisor = self.mps.supervisors.get(gpu_uuid)
        return supervisor is not None and supervisor.multiuser

    def priority(self, cls: ClientClass, gpu_uuids: Sequence[str] = ()) -> int:
        """The MPS priority a client of this class starts with on these GPUs (none: not known).

        Offline: what the controller chose for the GPUs (``SetOfflinePriority``), below online
        (1) where any of a gang's GPUs says so; else the policy's (baselines compare without it).
        """
        if cls is ClientClass.ONLINE:
            return 0
        configured = int(self.policy.offline_mps_priority)
        return max(
            (self.offline_priority.get(u, configured) for u in gpu_uuids), default=configured
        )

    def default_sm(self, cls: ClientClass, gpu_uuid: str) -> float:
        """The SM share a client of this class gets on this GPU unless it asked for one."""
        if cls is ClientClass.ONLINE:
            return 100.0
        return self.offline_share.get(gpu_uuid, self.config.control.offline_sm_pct_default)

    def shared(self, sample: GpuSample) -> bool:
        """Whether gpushare shares this GPU (``[gpus]`` in the config)."""
        # Asked several times per GPU per tick: kept until the config is replaced (a reload).
        if self._shared_for is not self.config:
            self._shared.clear()
            self._shared_for = self.config
        key = (sample.index, sample.uuid)
        found = self._shared.get(key)
        if found is None:
            found = self._shared[key] = self.config.for_gpu(sample.index, sample.uuid).shared
        return found

    def sample(self, gpu_uuid: str) -> GpuSample | None:
        """The last sample of a GPU."""
        return next((s for s in self.samples if s.uuid == gpu_uuid), None)

    def reserve(self, sample: GpuSample) -> int:
        """The memory kept free for online clients on this GPU."""
        return self.config.for_gpu(sample.index, sample.uuid).online_memory_reserve_bytes

    def max_clients(self, sample: GpuSample) -> int:
        """The MPS client slots of this GPU."""
        return self.config.for_gpu(sample.index, sample.uuid).max_clients


_SHARE_SETTING = "offline_share"


def _kept_shares(value: Any) -> dict[str, float]:
    """The kept offline shares; what is not a map of GPU to a percentage is ignored."""
    if not isinstance(value, dict):
        return {}
    return {
        str(gpu): float(pct)
        for gpu, pct in value.items()
        if isinstance(pct, int | float) and math.isfinite(pct) and 0.0 < pct <= 100.0
    }
