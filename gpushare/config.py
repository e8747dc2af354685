"""The daemon's configuration: one TOML file loaded into frozen dataclasses.

Defaults live in the dataclasses below and nowhere else; ``etc/gpushare/gpushare.toml`` documents
every key and loads to exactly these defaults (a test checks it). Field names carry their unit
(``period_s``, ``online_memory_reserve_bytes``); the TOML key is the name without the unit suffix
and takes a human spelling (``period = "100ms"``, ``online_memory_reserve = "2G"``).

Every bad input raises :class:`ConfigError`, which names the file, the key path and what would be
valid (:mod:`gpushare.tomlschema` reads the tables, as it reads the simulator's scenarios). Nothing is applied until the whole file has been validated, so a bad reload changes nothing.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpushare import paths
from gpushare.tomlschema import Reader, TomlError, show, toml_value, type_name
from gpushare.tomlschema import duration as _duration
from gpushare.tomlschema import num as _num
from gpushare.tomlschema import size as _size

# config.to_dict and config.toml_key, for config check and the tests that walk the keys.
from gpushare.tomlschema import to_dict as to_dict
from gpushare.tomlschema import toml_key as toml_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

CONFIG_VERSION = 1
CONFIG_ROLE = "the config file"
"""How :mod:`gpushare.trust` names the config file in its lines and its refusal counter."""
POLICY_NAMES = (
    "gpushare", "exclusive", "time-slicing", "mps", "mps-priority", "static-split", "tgs",
    "tally-like",
)  # fmt: skip
"""Every ``control.policy`` (``gpushare.control.registry`` builds them; a test keeps both equal)."""
GPU_KEY_RE = re.compile(r"^(\d+|GPU-[0-9a-fA-F-]+|MIG-[0-9a-fA-F-]+)$")
LogLevel = Literal["debug", "info", "warning", "error"]


class ConfigError(TomlError):
    """A config file that cannot be used; says where and what would be valid."""

    unnamed = "<config>"


@dataclass(frozen=True, slots=True)
class PathsConfig:
    """Where the daemon keeps its socket, state and MPS files.

    Paths left unset derive from ``runtime_dir``/``state_dir`` when the config is built, so setting
    ``runtime_dir`` alone moves everything that lives under it.
    """

    runtime_dir: Path = paths.RUNTIME_DIR
    state_dir: Path = paths.STATE_DIR
    socket: Path | None = None
    latency_socket: Path | None = None
    database: Path | None = None
    mps_pipe_dir: Path | None = None
    mps_log_dir: Path | None = None
    client_log_dir: Path | None = None
    # Where client cgroups go; None: beside the daemon in its delegated cgroup, or
    # <cgroup2 mount>/gpushare (gpushare.node.cgroups.discovery.default_base_dir). Never derived.
    cgroup_base: Path | None = None
    # The in-flight library clients preload; None: built next to the package. Set it where the
    # package lies in a directory other users cannot enter (a 0700 home, a private venv), whose
    # library their jobs could not load: `gpushare install` builds it there. Never derived.
    inflight_library: Path | None = None

    def __post_init__(self) -> None:
        derived = {
            "socket": self.runtime_dir / paths.SOCKET_NAME,
            "latency_socket": self.runtime_dir / paths.LATENCY_SOCKET_NAME,
            "database": self.state_dir / paths.DATABASE_NAME,
            "mps_pipe_dir": self.runtime_dir / paths.MPS_SUBDIR,
            "mps_log_dir": self.runtime_dir / paths.MPS_SUBDIR / "log",
            "client_log_dir": self.state_dir / paths.CLIENT_LOG_SUBDIR,
        }
        for name, value in derived.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    def resolved(self, name: str) -> Path:
        """A derived path, never ``None`` once the dataclass is built."""
        value = getattr(self, name)
        assert isinstance(value, Path)
        return value


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """The daemon process: logging, socket permissions, who may administer clients."""

    log_level: LogLevel = "info"
    # Everyone may read status (docs/design.md D7); rights to change a client are checked per request
    # through SO_PEERCRED, so the socket itself is world-connectable by default.
    socket_mode: str = "0666"
    socket_group: str = ""
    admin_group: str = "gpushare"
    max_request_bytes: int = _size(1 << 20, minimum=1024)
    # Fair use of the API socket (gpushare/daemon/server.py, docs/security.md): per-uid limits,
    # reserves for root and the admin group, and timeouts for idle and stalled connections.
    max_connections: int = _num(1024, minimum=1, maximum=1_000_000)
    admin_reserve_connections: int = _num(64, minimum=0, maximum=1_000_000)
    max_connections_per_uid: int = _num(64, minimum=1, maximum=1_000_000)
    api_workers: int = _num(8, minimum=2, maximum=256)
    admin_reserve_workers: int = _num(2, minimum=1, maximum=255)
    max_inflight_per_uid: int = _num(4, minimum=1, maximum=256)
    idle_timeout_s: float = _duration(600.0, above=True)
    request_timeout_s: float = _duration(10.0, above=True)
    # Offline jobs one uid may have queued at once (root and the admin group: no limit): a queued
    # job is a record the daemon keeps, so without a limit one user grows it without bound.
    max_queued_per_uid: int = _num(100, minimum=1, maximum=1_000_000)
    # A queued gang waiting this long reserves its GPUs, for at most gang_reserve_max (D15).
    gang_reserve_after_s: float = _duration(300.0, above=True)
    gang_reserve_max_s: float = _duration(3600.0, above=True)
    stop_mps_on_exit: bool = False
    # What offline work does while the daemon is down (docs/security.md, "on_stop"): "thaw" lets
    # it run unthrottled (nothing protects online work then), "freeze" keeps it frozen (no
    # offline progress, and no job can checkpoint, until the daemon is back).
    on_stop: Literal["thaw", "freeze"] = "thaw"
    cancel_grace_s: float = _duration(10.0)
    # Adoption ([[adopt]] rules, scheduler jobs): how often the host's processes are scanned, and
    # how old a process must be before it is decided (bench/adopt_scan.py: a first look at a
    # process reads it in full, later scans its stat alone: gpushare/daemon/factcache.py).
    adopt_scan_period_s: float = _duration(2.0, above=True)
    adopt_min_age_s: float = _duration(1.0)
    # The event log is pruned of events older than this and of the oldest beyond this many.
    events_max_age_s: float = _duration(30 * 86400.0, minimum=60.0)
    events_max_rows: int = _num(100_000, minimum=100, maximum=100_000_000)


@dataclass(frozen=True, slots=True)
class MpsConfig:
    """How gpushare runs and supervises one MPS control daemon per shared GPU (docs/design.md D1)."""

    control_binary: str = "nvidia-cuda-mps-control"
    compute_mode: Literal["exclusive_process", "leave"] = "exclusive_process"
    multiuser: Literal["auto", "on", "off"] = "auto"
    command_timeout_s: float = _duration(5.0, above=True)
    health_period_s: float = _duration(2.0, above=True)
    ready_timeout_s: float = _duration(10.0, above=True)
    restart_backoff_min_s: float = _duration(0.2, above=True)
    restart_backoff_max_s: float = _duration(30.0, above=True)
    quit_timeout_s: float = _duration(10.0)
    # At least 1: MPS rounds a share down to whole SMs (gpushare.mpsenv.SM_PCT_MIN).
    default_active_thread_pct: float = _num(100.0, minimum=1.0, maximum=100.0)
    max_clients: int = _num(48, minimum=1, maximum=128)


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """The control loop: SLO thresholds, duty-cycle steps, offline share, memory reserve.

    ``docs/controller.md`` justifies each default.
    """

    period_s: float = _duration(0.1, above=True)
    comfort_ratio: float = _num(0.8, minimum=0.0, maximum=1.0, above=True)
    violation_ratio: float = _num(1.0, minimum=0.0, maximum=10.0, above=True)
    hard_ratio: float = _num(2.0, minimum=1.0, maximum=100.0)
    cut_ratio: float = _num(1.05, minimum=1.0, maximum=100.0)
    probe_slo_ratio: float = _num(1.5, minimum=1.0, maximum=100.0, above=True)
    duty_increase_step: float = _num(0.05, minimum=0.0, maximum=1.0, above=True)
    duty_decrease_factor: float = _num(0.5, minimum=0.0, maximum=1.0)
    increase_after_ticks: int = _num(3, minimum=1, maximum=10_000)
    freeze_after_ticks: int = _num(5, minimum=1, maximum=10_000)
    slow_increase_after_ticks: int = _num(30, minimum=1, maximum=100_000)
    online_memory_reserve_bytes: int = _size(2 << 30)
    offline_sm_pct_default: float = _num(50.0, minimum=1.0, maximum=100.0)
    offline_sm_pct_min: float = _num(10.0, minimum=1.0, maximum=100.0)
    offline_sm_pct_max: float = _num(100.0, minimum=1.0, maximum=100.0)
    offline_mps_priority: int = _num(1, minimum=0, maximum=1)  # CUDA_MPS_CLIENT_PRIORITY (0, 1)
    # Online latency under this x its SLOs for share_min_interval: offline launches at 0 (0: off).
    equal_priority_below: float = _num(0.75, minimum=0.0, maximum=1.0)
    # The share's law for an LLM server: its steps slow by this of the proportional slowdown.
    token_sm_sensitivity: float = _num(0.91, minimum=0.0, maximum=1.0, above=True)
    share_hysteresis_pct: float = _num(10.0, minimum=0.0, maximum=100.0)
    share_min_interval_s: float = _duration(60.0)
    # Issue 32: a job's restart cost unless it declares one (a share restart must pay for it).
    restart_cost_s: float = _duration(60.0)
    share_headroom_pct: float = _num(10.0, minimum=0.0, maximum=100.0)
    quiet_settle_s: float = _duration(1.0)
    evict_grace_s: float = _duration(5.0)
    max_client_failures: int = _num(5, minimum=1, maximum=1000)
    failure_backoff_min_s: float = _duration(5.0)
    failure_backoff_max_s: float = _duration(300.0)
    gate_delay_max_s: float = _duration(0.3)
    gate_delay_min_s: float = _duration(0.002, above=True)
    gate_delay_raise_after_ticks: int = _num(5, minimum=1, maximum=100_000)
    gate_delay_trust_s: float = _duration(60.0)
    gate_delay_loose_below: float = _num(0.75, minimum=0.0, maximum=1.0)
    # Issue 32: the most a start-up measured at the job's first GPU work counts as its cost.
    restart_cost_measured_max_s: float = _duration(300.0)
    # The sharing policy the daemon runs (gpushare.control.registry.POLICY_NAMES).
    policy: str = "gpushare"


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """The per-GPU latency probe (an MPS client launching a tiny kernel)."""

    enabled: bool = True
    period_s: float = _duration(0.05, above=True)
    window_s: float = _duration(1.0, above=True)
    baseline_window_s: float = _duration(60.0, above=True)
    kernel_spin_cycles: int = _num(20_000, minimum=1, maximum=10**9)
    restart_backoff_min_s: float = _duration(1.0, above=True)
    restart_backoff_max_s: float = _duration(60.0, above=True)


@dataclass(frozen=True, slots=True)
class LatencyConfig:
    """Latency that online clients report themselves or expose as a Prometheus histogram."""

    window_s: float = _duration(2.0, above=True)
    min_samples: int = _num(20, minimum=1, maximum=1_000_000)
    scrape_period_s: float = _duration(1.0, above=True)
    # An LLM server's TTFT, and by default TPOT, come once per request (0.2-0.6/s): 120 s holds
    # min_samples (docs/controller.md, "LLM servers"); per-token TPOTs keep the last 5000.
    ttft_window_s: float = _duration(120.0, above=True)
    ttft_max_samples: int = _num(200, minimum=1, maximum=1_000_000)
    tpot_window_s: float = _duration(120.0, above=True)
    tpot_max_samples: int = _num(5000, minimum=1, maximum=1_000_000)


@dataclass(frozen=True, slots=True)
class GateConfig:
    """Request gating: online request boundaries freeze the GPU's gated offline clients.

    ``docs/controller.md`` ("Request gating") justifies each default.
    """

    hold_s: float = _duration(0.002)
    inflight_timeout_s: float = _duration(5.0, above=True)
    busy_window_s: float = _duration(10.0, above=True)
    max_busy: float = _num(0.9, minimum=0.0, maximum=1.0)
    gauge_period_s: float = _duration(0.05, above=True)
    max_datagrams_per_s: int = _num(20_000, minimum=1, maximum=10_000_000)
    realtime_threads: bool = True
    shallow_queue: Literal["bounded", "blocking"] = "bounded"
    inflight_kernels: int = _num(4, minimum=1, maximum=64)


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """The Prometheus exporter. 9402 avoids dcgm-exporter (9400) and HAMi (9394)."""

    enabled: bool = True
    listen: str = "127.0.0.1:9402"


@dataclass(frozen=True, slots=True)
class GpuOverride:
    """Per-GPU settings, keyed by UUID or index under ``[gpus."<key>"]``."""

    shared: bool = True
    online_memory_reserve_bytes: int | None = field(default=None, metadata={"kind": "size"})
    offline_sm_pct_max: float | None = field(
        default=None, metadata={"min": 1.0, "max": 100.0, "above": False}
    )
    max_clients: int | None = field(default=None, metadata={"min": 1, "max": 128})


AdoptClass = Literal["online", "offline", "marker"]


@dataclass(frozen=True, slots=True)
class AdoptRule:
    """One ``[[adopt]]`` table: which running processes gpushare adopts as clients, and as what.

    Conditions (every one given must hold, at least one is required): ``marker`` (the process has
    ``GPUSHARE_CLASS`` in its environment), ``unit`` (a glob on its systemd unit), ``cgroup`` (a
    glob on its cgroup v2 path), ``user`` (a name or uid), ``uses_gpu`` (NVML lists it as a compute
    process), ``env`` (globs on environment variables). ``class = "marker"`` takes the class (and
    the SLO) from the process's own ``GPUSHARE_CLASS``/``GPUSHARE_SLO_P99``. The matcher is
    :mod:`gpushare.control.adoption`.
    """

    name: str = ""
    marker: bool = False
    unit: str = ""
    cgroup: str = ""
    user: str = ""
    uses_gpu: bool = False
    env: Mapping[str, str] = field(
        default_factory=dict,
        metadata={"kind": "strmap", "read": lambda r, v, k: _string_table(r, v, k)},
    )
    cls: AdoptClass = field(default="marker", metadata={"key": "class"})
    slo_p99_s: float | None = field(
        default=None, metadata={"kind": "duration", "min": 0.0, "above": True}
    )
    # An LLM server's token SLOs (docs/controller.md, "LLM servers"), as submit --slo-ttft-p99.
    slo_ttft_p99_s: float | None = field(
        default=None, metadata={"kind": "duration", "min": 0.0, "max": 3600.0, "above": True}
    )
    slo_tpot_p99_s: float | None = field(
        default=None, metadata={"kind": "duration", "min": 0.0, "max": 3600.0, "above": True}
    )
    sm_pct: float | None = field(default=None, metadata={"min": 1.0, "max": 100.0, "above": False})
    mem_bytes: int | None = field(default=None, metadata={"kind": "size", "min": 1 << 20})


MARKER_RULE = AdoptRule(name="marker", marker=True, uses_gpu=True, cls="marker")
"""The default rule: a GPU process started with ``gpushare env`` (or any ``GPUSHARE_CLASS``) is
adopted in the class it declares. Its owner asked for it, so no further right is needed.
``uses_gpu``: a shell that exported the marker to start its job is not itself a client (freezing
it would freeze a terminal); the GPU processes it starts are."""


@dataclass(frozen=True, slots=True)
class Config:
    """The whole daemon configuration."""

    version: int = CONFIG_VERSION
    paths: PathsConfig = field(default_factory=PathsConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    mps: MpsConfig = field(default_factory=MpsConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    latency: LatencyConfig = field(default_factory=LatencyConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    gpus: Mapping[str, GpuOverride] = field(
        default_factory=dict, metadata={"read": lambda r, v, k: _gpu_table(r, v, k)}
    )
    adopt: tuple[AdoptRule, ...] = field(
        default=(MARKER_RULE,), metadata={"read": lambda r, v, k: _rule_list(r, v, k)}
    )

    def gpu_override(self, index: int, uuid: str) -> GpuOverride:
        """The ``[gpus]`` entry of a GPU as written; a UUID key wins over an index key (entirely)."""
        return self.gpus.get(uuid) or self.gpus.get(str(index)) or GpuOverride()

    def for_gpu(self, index: int, uuid: str) -> GpuConfig:
        """One GPU's settings: its ``[gpus]`` entry over the node-wide ones (the one resolution)."""
        o = self.gpu_override(index, uuid)
        return GpuConfig(
            shared=o.shared,
            online_memory_reserve_bytes=(
                self.control.online_memory_reserve_bytes
                if o.online_memory_reserve_bytes is None
                else o.online_memory_reserve_bytes
            ),
            offline_sm_pct_max=(
                self.control.offline_sm_pct_max
                if o.offline_sm_pct_max is None
                else o.offline_sm_pct_max
            ),
            max_clients=self.mps.max_clients if o.max_clients is None else o.max_clients,
        )


@dataclass(frozen=True, slots=True)
class GpuConfig:
    """One GPU's effective settings (:meth:`Config.for_gpu`): nothing left to fall back on."""

    shared: bool
    online_memory_reserve_bytes: int
    offline_sm_pct_max: float
    max_clients: int


def load(path: Path | str) -> Config:
    """Read and validate a config file.

    Raises:
        ConfigError: the file is unreadable, not TOML, or has a bad key or value.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read the file: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(path, "", "the file is not UTF-8 text") from exc
    return loads(text, path)


def loads(text: str, file: Path | str | None = None) -> Config:
    """Validate TOML text as a config; ``file`` only names the source in errors.

    Raises:
        ConfigError: bad TOML or a bad key or value.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(file, "", f"not valid TOML: {exc}") from exc
    return from_dict(data, file)


def from_dict(data: Mapping[str, Any], file: Path | str | None = None) -> Config:
    """Build a :class:`Config` from parsed TOML.

    Raises:
        ConfigError: a bad key or value.
    """
    config: Config = Reader(file, ConfigError).table(Config, data, "")
    if config.version != CONFIG_VERSION:
        raise ConfigError(file, "version", f"unsupported version {config.version}; use 1")
    _check_cross_field(config, file)
    return config


def _check_cross_field(config: Config, file: Path | str | None) -> None:
    library = config.paths.inflight_library
    if library is not None and not library.is_absolute():  # clients preload it from their cwd
        raise ConfigError(
            file, "paths.inflight_library", f"must be an absolute path, not {library}"
        )
    daemon = config.daemon
    if daemon.admin_reserve_workers >= daemon.api_workers:
        raise ConfigError(file, "daemon.admin_reserve_workers", "must be below daemon.api_workers")
    control = config.control
    low, top = control.offline_sm_pct_min, control.offline_sm_pct_max
    if low > top:
        raise ConfigError(
            file, "control.offline_sm_pct_min", "must not exceed control.offline_sm_pct_max"
        )
    if not low <= control.offline_sm_pct_default <= top:
        raise ConfigError(
            file,
            "control.offline_sm_pct_default",
            "must lie between control.offline_sm_pct_min and control.offline_sm_pct_max",
        )
    if control.comfort_ratio > control.violation_ratio:
        raise ConfigError(file, "control.comfort_ratio", "must not exceed control.violation_ratio")
    if control.policy not in POLICY_NAMES:
        raise ConfigError(
            file,
            "control.policy",
            f"unknown policy {control.policy!r}; valid policies: {', '.join(POLICY_NAMES)}",
        )
    if control.policy == "tally-like":
        raise ConfigError(
            file,
            "control.policy",
            '"tally-like" preempts offline kernels, which MPS cannot do: it exists for '
            "gpushare sim to compare against; use gpushare (or another policy) on a node",
        )
    if control.hard_ratio < control.violation_ratio:
        raise ConfigError(file, "control.hard_ratio", "must be at least control.violation_ratio")
    if not control.violation_ratio <= control.cut_ratio <= control.hard_ratio:
        raise ConfigError(
            file,
            "control.cut_ratio",
            "must lie between control.violation_ratio and control.hard_ratio",
        )
    if 0 < control.gate_delay_max_s < control.gate_delay_min_s:
        raise ConfigError(
            file,
            "control.gate_delay_min",
            "must not exceed control.gate_delay_max (gate_delay_max = 0 turns the delay off)",
        )
    if config.gate.hold_s >= config.gate.inflight_timeout_s:
        # A gate is never closed longer than the timeout after its last signal only so.
        raise ConfigError(file, "gate.hold", "must be shorter than gate.inflight_timeout")
    for prefix, lo, hi in (
        ("mps.restart_backoff", config.mps.restart_backoff_min_s, config.mps.restart_backoff_max_s),
        ("probe.restart_backoff", config.probe.restart_backoff_min_s,
         config.probe.restart_backoff_max_s),
        ("control.failure_backoff", control.failure_backoff_min_s,
         control.failure_backoff_max_s),
    ):  # fmt: skip
        if lo > hi:
            raise ConfigError(file, f"{prefix}_min", f"must not exceed {prefix}_max")
    try:
        mode = int(config.daemon.socket_mode, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise ConfigError(
            file, "daemon.socket_mode", 'expected an octal mode such as "0660" or "0666"'
        )
    host, _, port = config.metrics.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(file, "metrics.listen", 'expected HOST:PORT such as "127.0.0.1:9402"')
    for name in ("runtime_dir", "state_dir", *_DERIVED_PATHS):
        value = config.paths.resolved(name)
        if not value.is_absolute():
            raise ConfigError(file, f"paths.{name}", f"must be an absolute path, got {value!s}")


_DERIVED_PATHS = (
    "socket",
    "latency_socket",
    "database",
    "mps_pipe_dir",
    "mps_log_dir",
    "client_log_dir",
)


def _gpu_table(r: Reader, value: Any, key: str) -> dict[str, GpuOverride]:
    if not isinstance(value, Mapping):
        r.fail(key, f"expected a table of GPUs, got {type_name(value)}")
    out = {}
    for gpu_key, sub in value.items():
        if not GPU_KEY_RE.match(gpu_key):
            r.fail(f"{key}.{gpu_key}", 'GPU keys are an index ("0") or a UUID ("GPU-…")')
        out[gpu_key] = r.table(GpuOverride, sub, f"{key}.{gpu_key}.")
    return out


_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_UNIT_GLOB_RE = re.compile(r"^[A-Za-z0-9:_.@\\*?\[\]!-]+$")


def _string_table(r: Reader, value: Any, key: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        r.fail(key, f'expected a table such as {{ SLURM_JOB_ID = "*" }}, got {type_name(value)}')
    for name, pattern in value.items():
        if not _ENV_NAME_RE.match(name):
            r.fail(f"{key}.{name}", "not an environment variable name")
        if not isinstance(pattern, str):
            r.fail(f"{key}.{name}", f"expected a string (a glob), got {show(pattern)}")
    return dict(value)


def _rule_list(r: Reader, value: Any, key: str) -> tuple[AdoptRule, ...]:
    if not isinstance(value, list):
        r.fail(key, f"expected [[{key}]] tables, got {type_name(value)}")
    rules: list[AdoptRule] = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        rule: AdoptRule = r.table(AdoptRule, item, where + ".")
        if not rule.name:
            rule = dataclasses.replace(rule, name=where)
        _check_rule(rule, r.file, where)
        if any(x.name == rule.name for x in rules):
            r.fail(f"{where}.name", f"{rule.name!r} names an earlier rule too")
        rules.append(rule)
    return tuple(rules)


def _check_rule(rule: AdoptRule, file: Path | str | None, where: str) -> None:
    if not (rule.marker or rule.unit or rule.cgroup or rule.user or rule.uses_gpu or rule.env):
        raise ConfigError(
            file, where, "matches every process: give at least one of marker, unit, cgroup, "
            "user, uses_gpu, env",
        )  # fmt: skip
    if rule.cls == "marker" and not rule.marker:
        raise ConfigError(
            file, f"{where}.class", 'give class = "online" or "offline"; "marker" (the default) '
            "takes it from GPUSHARE_CLASS and needs marker = true",
        )  # fmt: skip
    slos = (
        ("slo_p99", rule.slo_p99_s),
        ("slo_ttft_p99", rule.slo_ttft_p99_s),
        ("slo_tpot_p99", rule.slo_tpot_p99_s),
    )
    for key, slo_s in slos:
        if slo_s is not None and rule.cls == "offline":
            raise ConfigError(file, f"{where}.{key}", "applies to online clients only")
    if rule.unit and not _UNIT_GLOB_RE.match(rule.unit):
        raise ConfigError(file, f"{where}.unit", f"not a unit name or glob: {rule.unit!r}")
    if rule.cgroup and not rule.cgroup.startswith("/"):
        raise ConfigError(
            file,
            f"{where}.cgroup",
            'a cgroup v2 path from the hierarchy\'s root, e.g. "/system.slice/*"',
        )
    if rule.user and not re.match(r"^[a-z_][a-z0-9_.-]*\$?$|^\d+$", rule.user):
        raise ConfigError(file, f"{where}.user", f"not a user name or uid: {rule.user!r}")


def to_toml(config: Config) -> str:
    """Render the effective config as TOML text that :func:`loads` reads back to the same value."""
    data = to_dict(config)
    lines: list[str] = []
    # Top-level keys come before the first table; an empty rule list is one of them.
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict | list) or v == []}
    lines += [f"{k} = {toml_value(v)}" for k, v in scalars.items()]
    for section, body in data.items():
        if not isinstance(body, dict):
            continue
        if section == "gpus":
            for gpu_key, sub in body.items():
                lines += ["", f'[gpus."{gpu_key}"]']
                lines += [f"{k} = {toml_value(v)}" for k, v in sub.items()]
            continue
        lines += ["", f"[{section}]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in body.items()]
    for rule in data.get("adopt", []):
        lines += ["", "[[adopt]]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in rule.items()]
    return "\n".join(lines) + "\n"
