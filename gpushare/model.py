"""Domain types shared by the controller, the daemon, the simulator and the CLI.

Everything here is a frozen value with units in its field names. The sensors build
:class:`Observation` values, the pure controller (:mod:`gpushare.control`) turns an observation into
:data:`Action` values, and the daemon or the simulator applies them. Nothing in this module does I/O.

Duty cycle semantics (shared by every runner):
    Each GPU has an offline duty fraction ``d`` in [0, 1], set by :class:`SetDuty`. In every control
    period the runner thaws that GPU's offline clients for ``d`` of the period and freezes them for
    the rest (``d == 1``: never frozen; ``d == 0``: frozen all the time). :class:`Freeze` puts a hold
    on one client that keeps it frozen whatever the duty until a matching :class:`Thaw`.
    Online clients are never frozen by the duty cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

QUEUE_MODES = ("shallow", "deep", "auto")
"""``submit --offline --queue``: how many kernels an offline client may have queued on its GPU
(docs/controller.md, "Shallow offline queues"); ``None`` is :data:`DEFAULT_QUEUE_MODE`."""

DEFAULT_QUEUE_MODE = "deep"
"""The queue mode of an offline job whose record names none: a job submitted before ``auto`` became
the default (issue 32) keeps running as it was launched."""

DEFAULT_OFFLINE_QUEUE = "auto"
"""The queue an offline job is recorded with when it asks for none: ``submit --offline`` without
``--queue`` and a scenario's ``[[offline]]`` without ``queue`` alike (issue 32; ``deep`` before).
A job opts out with ``--queue deep``."""


def queue_mode(asked: str | None) -> str:
    """The queue mode an offline job runs under: what it asked, else :data:`DEFAULT_QUEUE_MODE`."""
    return asked if asked is not None else DEFAULT_QUEUE_MODE


class ClientClass(str, Enum):
    """Whether a client is latency-critical (online) or best-effort (offline)."""

    ONLINE = "online"
    OFFLINE = "offline"

    @property
    def mps_priority(self) -> int:
        """``CUDA_MPS_CLIENT_PRIORITY``: online 0 (normal), offline 1 (below normal)."""
        return 0 if self is ClientClass.ONLINE else 1


class ClientState(str, Enum):
    """Life cycle of a client as the registry records it."""

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    THROTTLED = "throttled"
    FROZEN = "frozen"
    RESTARTING = "restarting"
    EXITED = "exited"
    FAILED = "failed"
    LOST = "lost"

    @property
    def is_live(self) -> bool:
        """A process may exist for a client in this state."""
        return self in _LIVE_STATES

    @property
    def is_final(self) -> bool:
        """No further transition leaves this state."""
        return self in (ClientState.EXITED, ClientState.FAILED, ClientState.LOST)


_LIVE_STATES = frozenset(
    {
        ClientState.STARTING,
        ClientState.RUNNING,
        ClientState.THROTTLED,
        ClientState.FROZEN,
        ClientState.RESTARTING,
    }
)


class PauseMechanism(str, Enum):
    """How a client is frozen: the cgroup v2 freezer, or SIGSTOP/SIGCONT of its process group."""

    CGROUP = "cgroup"
    SIGNAL = "signal"


class MpsState(str, Enum):
    """Health of the MPS control daemon and server of one GPU, as the controller sees it."""

    UP = "up"
    STARTING = "starting"
    FAULT = "fault"
    DOWN = "down"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Limits:
    """The MPS limits a client is started with; MPS fixes them for the client's lifetime."""

    sm_pct: float
    pinned_mem_bytes: int | None
    priority: int


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """GPU memory NVML attributes to one process (``None`` where the driver hides it)."""

    pid: int
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class SmPeriod:
    """One sampling period of the driver's per-process SM utilisation.

    ``pids`` are the processes that used the SMs in the period that ended at ``at_wall_s`` (NVML's
    CPU timestamp, seconds since the epoch): NVML lists only processes with non-zero utilisation,
    so a process absent from a period it could have appeared in did no GPU work in it.
    """

    at_wall_s: float
    pids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU's NVML readings for one tick. ``None`` means "could not be read", never zero.

    ``error`` says why readings are missing; ``lost`` is set when NVML reported the GPU lost or a
    call hung, and the controller then stops admissions there.

    ``sm_periods`` are the driver's per-process SM sampling periods that ended since the previous
    sample, oldest first (``()``: none ended, or no process used the SMs; ``None``: the driver
    gives no per-process utilisation). ``compute_mode`` is NVML's (``"default"``,
    ``"exclusive_process"``, ``"prohibited"``; ``None``: unreadable).
    """

    index: int
    uuid: str
    name: str | None = None
    sm_count: int | None = None
    mem_total_bytes: int | None = None
    mem_used_bytes: int | None = None
    mem_free_bytes: int | None = None
    gpu_util_pct: float | None = None
    mem_util_pct: float | None = None
    sm_active_pct: float | None = None
    temperature_c: int | None = None
    power_mw: int | None = None
    sm_clock_mhz: int | None = None
    throttle_reasons: int | None = None
    processes: tuple[ProcessMemory, ...] = ()
    sm_periods: tuple[SmPeriod, ...] | None = None
    compute_mode: str | None = None
    error: str | None = None
    lost: bool = False


@dataclass(frozen=True, slots=True)
class GpuEvent:
    """A critical GPU event (an XID) read from NVML's event set."""

    gpu_uuid: str
    xid: int
    at_s: float
    fatal: bool


@dataclass(frozen=True, slots=True)
class ProbeReading:
    """Latency of the probe kernel on one GPU over the probe window.

    ``latency_ms`` is wait plus run time (CUDA events), ``run_ms`` the kernel's own run time. Both
    are the window's p99. ``ratio`` is ``latency_ms / baseline_ms``. When the probe has no reading,
    the numbers are ``None`` and ``reason`` says why (``"unavailable: no CUDA driver"``).
    """

    latency_ms: float | None = None
    run_ms: float | None = None
    baseline_ms: float | None = None
    ratio: float | None = None
    samples: int = 0
    reason: str | None = None


class MpsEventKind(str, Enum):
    """What a line of the MPS control daemon's output, or the supervisor itself, reported."""

    COMMAND = "command"
    SERVER_STARTED = "server_started"
    SERVER_READY = "server_ready"
    SERVER_EXITED = "server_exited"
    FATAL_EXCEPTION = "fatal_exception"
    CLIENT_CONNECTED = "client_connected"
    CLIENT_DISCONNECTED = "client_disconnected"
    DAEMON_STARTED = "daemon_started"
    DAEMON_EXITED = "daemon_exited"
    DAEMON_RESTARTED = "daemon_restarted"
    RECOVERY_STEP = "recovery_step"
    RAW = "raw"


@dataclass(frozen=True, slots=True)
class MpsEvent:
    """One event from the supervised MPS control daemon of a GPU."""

    kind: MpsEventKind
    gpu_uuid: str
    at_s: float
    text: str
    server_pid: int | None = None
    client_pid: int | None = None
    uid: int | None = None
    status: int | None = None


@dataclass(frozen=True, slots=True)
class ClientView:
    """What the controller may know about one client on a GPU.

    ``p99_ms`` is the app-reported p99 over the latency window, ``None`` with ``p99_reason`` when
    the client reports nothing. ``ceiling_sm_pct`` is the share a user declared (``--sm``): an
    offline client's share never goes above it.
    ``queue`` is an offline client's ``submit --queue`` (``None``: the default,
    :data:`DEFAULT_QUEUE_MODE`) and ``shallow`` whether it
    runs with a shallow queue now (``CUDA_LAUNCH_BLOCKING=1``, docs/controller.md).
    ``live_queue``: its queue follows request gating without a restart (the in-flight library's
    control file, issue 32), so the controller never restarts it to switch queues.
    ``restart_cost_s``: what a restart costs the job (start-up and lost work; declared or
    measured), ``None``: the controller's default; ``restart_cost_measured``: it is the daemon's
    measurement (``gpushare.daemon.startcost``); ``restarts`` how often it was restarted.
    """

    client_id: str
    cls: ClientClass
    state: ClientState
    limits: Limits
    uid: int
    pid: int | None = None
    mem_used_bytes: int | None = None
    slo_p99_ms: float | None = None
    p99_ms: float | None = None
    p99_reason: str | None = None
    restartable: bool = False
    ceiling_sm_pct: float | None = None
    failures: int = 0
    started_at_s: float | None = None
    held: bool = False
    queue: str | None = None
    shallow: bool = False
    live_queue: bool = False
    restart_cost_s: float | None = None
    restart_cost_measured: bool = False
    restarts: int = 0
    # An LLM server's token SLOs and their p99s over their windows (docs/controller.md, "LLM
    # servers"): time to first token and time per output token, milliseconds.
    slo_ttft_p99_ms: float | None = None
    ttft_p99_ms: float | None = None
    slo_tpot_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    #: The GPUs the client's gang spans (issue 35: a DDP job's ranks, a TP server's shards);
    #: 1 for a one-GPU client.
    gang_gpus: int = 1
    #: An offline gang's smallest offline share (percent) among its *other* GPUs; None for a
    #: one-GPU client. The gang runs at the smallest share of its GPUs (as admission starts it),
    #: so one GPU's controller restarts it only for what that smallest share allows.
    gang_share_pct: float | None = None


@dataclass(frozen=True, slots=True)
class QueuedJob:
    """An offline job waiting for admission (node level, not per GPU)."""

    client_id: str
    uid: int
    mem_bytes: int | None
    sm_pct: float | None
    gpu: str | None
    submitted_at_s: float
    expected_duration_s: float | None = None
    restartable: bool = False
    not_before_s: float = 0.0
    ranks: int = 1
    """A gang's GPUs (``submit --gpus``, issue 35): it starts on ``ranks`` GPUs at once or waits."""
    gang_gpus: tuple[str, ...] = ()
    """The GPUs a gang named (``--gpus 0,1``), by UUID in rank order; empty: any ``ranks``."""


@dataclass(frozen=True, slots=True)
class GateReading:
    """A GPU's request gate (docs/controller.md, "Request gating") as the runner measures it.

    Attributes:
        enabled: gating is on (the last ``SetGating``).
        closed: requests are in flight (or within the hold) and gating is on: gated offline
            clients are frozen.
        inflight: requests in flight now (sources silent for ``[gate] inflight_timeout`` count 0).
        signalled_clients: live online clients that sent request boundaries or have a gauge.
        busy_fraction: share of the last ``[gate] busy_window`` with requests in flight (or
            held), measured whether gating is on or off; ``None`` before a second of history.
        max_busy: ``[gate] max_busy``, filled in by the runner from the config.
        closes: how many times the gate closed since the runner started.
        delay_s: the gate closes once requests have been in flight this long (the last
            ``SetGating``'s delay).
    """

    enabled: bool
    closed: bool
    inflight: int
    signalled_clients: int
    busy_fraction: float | None
    max_busy: float = 0.9
    closes: int = 0
    delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything the controller sees of one GPU at one tick, and nothing it must not touch."""

    gpu_uuid: str
    gpu_index: int
    sample: GpuSample
    probe: ProbeReading
    clients: tuple[ClientView, ...]
    mps_state: MpsState
    mps_events: tuple[MpsEvent, ...] = ()
    gpu_events: tuple[GpuEvent, ...] = ()
    mem_reserve_bytes: int = 0
    offline_sm_pct_max: float = 100.0
    admissions_open: bool = True
    gate: GateReading | None = None
    #: The driver time-slices the GPU's clients (each has a context of its own, no MPS server
    #: shares the GPU between them): the GPU already alternates them in hardware.
    time_sliced: bool = False
    # online() and offline(), made at the first call: the controller asks for them about ten
    # times per GPU per tick, and each was a pass over every client (the observation is frozen,
    # so the answer never changes). Not fields a caller sets, compares or sees.
    _online: tuple[ClientView, ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _offline: tuple[ClientView, ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def online(self) -> tuple[ClientView, ...]:
        """The live online clients on this GPU."""
        return self._live(ClientClass.ONLINE, "_online")

    def offline(self) -> tuple[ClientView, ...]:
        """The live offline clients on this GPU."""
        return self._live(ClientClass.OFFLINE, "_offline")

    def _live(self, cls: ClientClass, slot: str) -> tuple[ClientView, ...]:
        # Asked about ten times per step: made once per observation (it is frozen).
        found: tuple[ClientView, ...] | None = getattr(self, slot)
        if found is None:
            found = tuple(c for c in self.clients if c.cls is cls and c.state.is_live)
            object.__setattr__(self, slot, found)
        return found


# Actions: what the controller asks the daemon (or the simulator) to do. Each says why.


@dataclass(frozen=True, slots=True)
class Freeze:
    """Hold one offline client frozen whatever the duty cycle, until a :class:`Thaw`."""

    client_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Thaw:
    """Release a :class:`Freeze` hold; the client follows the duty cycle again."""

    client_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class SetDuty:
    """Set the offline duty fraction of a GPU (see the module docstring)."""

    gpu_uuid: str
    duty: float
    reason: str


@dataclass(frozen=True, slots=True)
class SetGating:
    """Turn request gating on or off for a GPU (docs/controller.md, "Request gating").

    ``delay_s``: the gate closes only once requests have been in flight that long without a gap
    (docs/controller.md, "Gate delay"); 0 closes it at the first request.
    """

    gpu_uuid: str
    on: bool
    reason: str
    delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SetOfflineShare:
    """Set the SM percentage new and restarted offline clients of a GPU are started with."""

    gpu_uuid: str
    sm_pct: float
    reason: str


@dataclass(frozen=True, slots=True)
class SetOfflinePriority:
    """Set the MPS priority new and restarted offline clients of a GPU start with.

    ``CUDA_MPS_CLIENT_PRIORITY``: 1, below online clients, or 0, theirs (docs/controller.md,
    "Offline priority per GPU"). A running client keeps the priority it started with.
    """

    gpu_uuid: str
    priority: int
    reason: str


@dataclass(frozen=True, slots=True)
class RestartClient:
    """Checkpoint-signal a restartable offline client and relaunch it under ``sm_pct``."""

    client_id: str
    sm_pct: float
    reason: str


@dataclass(frozen=True, slots=True)
class Evict:
    """Remove an offline client (terminate_client, then kill); requeue it when restartable."""

    client_id: str
    requeue: bool
    reason: str


@dataclass(frozen=True, slots=True)
class RecoverMps:
    """Run the MPS recovery operation on a GPU (offline clients removed first)."""

    gpu_uuid: str
    reason: str


@dataclass(frozen=True, slots=True)
class Admit:
    """Start a queued offline job on a GPU with an SM percentage."""

    client_id: str
    gpu_uuid: str
    sm_pct: float
    reason: str
    gang: tuple[str, ...] = ()
    """A gang's GPUs by UUID in rank order (``gpu_uuid`` is rank 0's); empty for one GPU."""


class Severity(str, Enum):
    """How loudly an :class:`Alert` should be raised."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


@dataclass(frozen=True, slots=True)
class Alert:
    """Something an operator should know about; logged and shown in ``gpushare events``."""

    gpu_uuid: str
    severity: Severity
    reason: str


Action = (
    Freeze
    | Thaw
    | SetDuty
    | SetGating
    | SetOfflineShare
    | SetOfflinePriority
    | RestartClient
    | Evict
    | RecoverMps
    | Admit
    | Alert
)


@dataclass(frozen=True, slots=True)
class ProcessFacts:
    """What adoption knows about one running process."""

    pid: int
    ppid: int
    uid: int
    user: str
    name: str
    start_time: float
    cgroup: str | None
    """cgroup v2 path from the hierarchy's root (``/system.slice/x.service``); ``None``: no v2."""
    unit: str | None
    """The systemd unit whose cgroup holds the process (``x.service``, ``session-3.scope``)."""
    environ: Mapping[str, str] | None
    """The variables adoption reads (``gpushare.control.adoption.FACT_ENV`` and rules' ``env`` names);
    ``None``: the environment could not be read (another user's process, the daemon not root)."""
    gpu_uuids: tuple[str, ...] | None
    """GPUs NVML lists the process on; ``None``: unknown (no NVML on this host)."""
    setuid: bool = False
    """It runs with rights its real user lacks (mixed uids or gids, or a setuid executable):
    only root's rules adopt it."""
