"""Scenario files: what runs on the simulated node, as TOML validated with clear errors.

A scenario names a node (GPUs), online services (a forward-pass profile and an arrival process),
offline jobs (a training-iteration profile) and optional overrides of gpushare's ``[control]``,
``[probe]`` and ``[latency]`` tables (same keys as ``gpushare.toml``). Data files are named relative
to gpushare's data folder (:func:`gpushare.sim.data.resolve`). Every bad value raises
:class:`ScenarioError` naming the file, the key and the fix. See ``gpushare/scenarios/README.md``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gpushare import config as gconfig
from gpushare.protocol import QUEUE_MODES
from gpushare.sim import data
from gpushare.sim.gpu import DEFAULT_SLICE_S, DEFAULT_SWITCH_S
from gpushare.sim.inflight import DEFAULT_INFLIGHT_WAKE_S
from gpushare.sim.workloads import DEFAULT_HOST_PER_KERNEL_S, request_alone_s
from gpushare.units import parse_duration, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

ArrivalKind = Literal["poisson", "azure", "genai"]


class ScenarioError(Exception):
    """A scenario file is bad; the message names the file, the key and the fix."""

    def __init__(self, file: Path | str | None, key: str, reason: str) -> None:
        self.file = str(file) if file is not None else "<scenario>"
        self.key = key
        self.reason = reason
        where = f"{self.file}: {key}" if key else self.file
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """The simulated GPUs of the node (all alike) and the model's calibrated constants."""

    count: int = 1
    sm_count: int = 80
    mem_total_bytes: int = 16 << 30
    parallel_fraction: float = 0.95
    bw_beta: float = 0.6
    slice_s: float = DEFAULT_SLICE_S
    switch_s: float = DEFAULT_SWITCH_S
    wave_scale: float = 1.0
    launch_gap_s: float = 10e-6
    #: Bounded in-flight mode (``GPUSHARE_MAX_INFLIGHT``): a freed slot to the next launch on the
    #: GPU (W3b).
    inflight_wake_s: float = DEFAULT_INFLIGHT_WAKE_S
    host_per_kernel_s: float = DEFAULT_HOST_PER_KERNEL_S
    #: A training job's CPU time per source kernel (W3: 0, hidden behind a deep queue); a
    #: sensitivity for shallow queues, which hide it only within their bound (W3b).
    train_host_per_kernel_s: float = 0.0
    merge_online_us: float = data.DEFAULT_MERGE_ONLINE_US
    merge_offline_us: float = data.DEFAULT_MERGE_OFFLINE_US
    start_s: float = 1.0
    #: A relaunch's start-up (issue 32: a real training job takes 30 s to minutes; was 5 s).
    restart_s: float = 60.0
    probe_kernel_s: float = 15e-6


@dataclass(frozen=True, slots=True)
class OnlineSpec:
    """An online service: requests of one forward pass, open loop."""

    name: str
    profile: str
    gpu: int = 0
    arrivals: ArrivalKind = "poisson"
    load: float | None = 0.5
    rps: float | None = None
    trace: str | None = None
    trace_start_s: float = 0.0
    trace_speedup: float = 1.0
    bin_s: float = 1.0
    sm_pct: float = 100.0
    mem_bytes: int = 2 << 30
    slo_p99_ms: float | None = None
    slo_factor: float = 1.1
    #: Poisson only: ``(at_s, for_s, factor)``, the rate times ``factor`` for a while.
    burst: tuple[float, float, float] | None = None
    #: ``CUDA_LAUNCH_BLOCKING=1``: one kernel in flight, a launch gap per kernel (W3).
    launch_blocking: bool = False
    #: The service tells the daemon when requests start and end (``gpushare.client``), so the
    #: daemon can gate offline work on them (docs/simulator.md, "Request gating").
    request_boundaries: bool = True


@dataclass(frozen=True, slots=True)
class OfflineSpec:
    """An offline training job: iterations of one profile in a closed loop."""

    name: str
    profile: str
    gpu: int = 0
    mem_bytes: int = 4 << 30
    pinned_mem_bytes: int | None = None
    restartable: bool = True
    submit_s: float = 1.0
    launch_blocking: bool = False
    #: ``gpushare submit --queue``: ``auto`` (shallow while the GPU's request gating is on),
    #: ``shallow`` (``CUDA_LAUNCH_BLOCKING=1``) or ``deep``.
    queue: str = "auto"
    #: Issue 32 (gpushare.sim.checkpoint): whether the job saves its state when signalled, and
    #: otherwise how often it checkpoints (``None``: never; a restart loses its whole run).
    checkpoint_on_signal: bool = True
    checkpoint_interval_s: float | None = None
    #: ``submit --restart-cost`` (issue 32); ``None``: the controller's ``restart_cost``.
    restart_cost_s: float | None = None


@dataclass(frozen=True, slots=True)
class Scenario:
    """A whole scenario."""

    name: str
    file: str
    description: str
    duration_s: float
    warmup_s: float
    seed: int
    gpu: GpuSpec
    online: tuple[OnlineSpec, ...]
    offline: tuple[OfflineSpec, ...]
    config: gconfig.Config


def shipped_dir() -> Path:
    """The scenarios shipped in the package (``gpushare/scenarios``)."""
    return data.package_dir("scenarios")


def shipped() -> list[str]:
    """Names of the shipped scenarios (``demo``, ``pairs/bert_2_fwd+bert_8_fb1``, ...)."""
    root = shipped_dir()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.toml"))


def find(name: Path | str) -> Path:
    """A scenario file: the path itself when it is a file, else the shipped scenario so named.

    Raises:
        ScenarioError: neither exists.
    """
    path = Path(name)
    if path.is_file():
        return path
    if not path.is_absolute() and ".." not in path.parts:
        root = shipped_dir()
        for candidate in (root / path, root / f"{path}.toml"):
            if candidate.is_file():
                return candidate
    raise ScenarioError(
        name,
        "",
        "no such file, and no shipped scenario of that name (`gpushare sim --list` lists them)",
    )


def load(path: Path | str) -> Scenario:
    """Read and validate a scenario file (a path, or the name of a shipped scenario).

    Raises:
        ScenarioError: no such file, unreadable file, bad TOML, or a bad key or value.
    """
    path = find(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(path, "", f"cannot read the file: {exc.strerror or exc}") from exc
    return loads(text, path)


def loads(text: str, file: Path | str | None = None) -> Scenario:
    """Parse a scenario from TOML text.

    Raises:
        ScenarioError: bad TOML or a bad key or value.
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(file, "", f"not valid TOML: {exc}") from exc
    r = _Reader(file)
    r.keys(doc, "", {"scenario", "gpu", "online", "offline", "control", "probe", "latency"})
    head = r.table(doc, "scenario", required=True)
    r.keys(head, "scenario.", {"name", "description", "duration", "warmup", "seed"})
    name = r.string(head, "scenario.", "name", default=Path(str(file or "scenario")).stem)
    duration = r.duration(head, "scenario.", "duration", default=30.0, above=0.0)
    warmup = r.duration(head, "scenario.", "warmup", default=2.0)
    if warmup >= duration:
        raise ScenarioError(file, "scenario.warmup", "must be shorter than scenario.duration")
    gpu = _gpu(r, r.table(doc, "gpu"))
    online = tuple(
        _online(r, t, f"online[{i}].", gpu) for i, t in enumerate(r.array(doc, "online"))
    )
    offline = tuple(
        _offline(r, t, f"offline[{i}].", gpu) for i, t in enumerate(r.array(doc, "offline"))
    )
    if not online and not offline:
        raise ScenarioError(file, "", "a scenario needs at least one [[online]] or [[offline]]")
    names = [s.name for s in online] + [s.name for s in offline]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ScenarioError(file, "name", f"client names must be unique; repeated: {dup}")
    overrides = {k: doc[k] for k in ("control", "probe", "latency") if k in doc}
    try:
        cfg = gconfig.from_dict(overrides, file)
    except gconfig.ConfigError as exc:
        raise ScenarioError(file, exc.key, exc.reason) from exc
    return Scenario(
        name=name,
        file=str(file or "<scenario>"),
        description=r.string(head, "scenario.", "description", default=""),
        duration_s=duration,
        warmup_s=warmup,
        seed=r.integer(head, "scenario.", "seed", default=1),
        gpu=gpu,
        online=online,
        offline=offline,
        config=cfg,
    )


def _gpu(r: _Reader, t: Mapping[str, Any]) -> GpuSpec:
    p = "gpu."
    r.keys(
        t,
        p,
        {
            "count",
            "sm_count",
            "mem_total",
            "parallel_fraction",
            "bw_beta",
            "slice",
            "switch",
            "wave_scale",
            "launch_gap",
            "inflight_wake",
            "host_per_kernel",
            "train_host_per_kernel",
            "merge_online_us",
            "merge_offline_us",
            "start",
            "restart",
            "probe_kernel",
        },
    )
    d = GpuSpec()
    spec = GpuSpec(
        count=r.integer(t, p, "count", default=d.count, low=1, high=64),
        sm_count=r.integer(t, p, "sm_count", default=d.sm_count, low=1, high=1024),
        mem_total_bytes=r.size(t, p, "mem_total", default=d.mem_total_bytes),
        parallel_fraction=r.number(t, p, "parallel_fraction", d.parallel_fraction, 0.0, 1.0),
        bw_beta=r.number(t, p, "bw_beta", d.bw_beta, 0.0, 10.0),
        slice_s=r.duration(t, p, "slice", default=d.slice_s, above=0.0),
        switch_s=r.duration(t, p, "switch", default=d.switch_s),
        wave_scale=r.number(t, p, "wave_scale", d.wave_scale, 0.05, 20.0),
        launch_gap_s=r.duration(t, p, "launch_gap", default=d.launch_gap_s),
        inflight_wake_s=r.duration(t, p, "inflight_wake", default=d.inflight_wake_s),
        host_per_kernel_s=r.duration(t, p, "host_per_kernel", default=d.host_per_kernel_s),
        train_host_per_kernel_s=r.duration(
            t, p, "train_host_per_kernel", default=d.train_host_per_kernel_s
        ),
        merge_online_us=r.number(t, p, "merge_online_us", d.merge_online_us, 0.0, 10_000.0),
        merge_offline_us=r.number(t, p, "merge_offline_us", d.merge_offline_us, 0.0, 10_000.0),
        start_s=r.duration(t, p, "start", default=d.start_s),
        restart_s=r.duration(t, p, "restart", default=d.restart_s),
        probe_kernel_s=r.duration(t, p, "probe_kernel", default=d.probe_kernel_s, above=0.0),
    )
    if spec.mem_total_bytes <= 0:
        raise ScenarioError(r.file, "gpu.mem_total", "must be a positive size such as '16GiB'")
    return spec


def _online(r: _Reader, t: Mapping[str, Any], p: str, gpu: GpuSpec) -> OnlineSpec:
    r.keys(
        t,
        p,
        {
            "name",
            "profile",
            "gpu",
            "arrivals",
            "load",
            "rps",
            "trace",
            "trace_start",
            "trace_speedup",
            "bin",
            "sm_pct",
            "mem",
            "slo_p99_ms",
            "slo_factor",
            "burst",
            "launch_blocking",
            "request_boundaries",
        },
    )
    arrivals = r.string(t, p, "arrivals", default="poisson")
    if arrivals not in ("poisson", "azure", "genai"):
        raise ScenarioError(r.file, p + "arrivals", "expected 'poisson', 'azure' or 'genai'")
    rps = r.opt_number(t, p, "rps", 0.0, 100_000.0)
    load = r.load(t, p)
    if rps is not None and load is not None:
        raise ScenarioError(r.file, p + "rps", "give either rps or load, not both")
    if rps is None and load is None:
        load = 0.5
    trace = r.opt_string(t, p, "trace")
    if arrivals != "poisson" and trace is None:
        raise ScenarioError(r.file, p + "trace", f"arrivals = '{arrivals}' needs a trace file")
    if trace is not None:
        r.data_file(p + "trace", trace)
    profile = r.profile(t, p, gpu.merge_online_us, gpu.sm_count)
    if arrivals == "poisson" and rps is not None:
        # A steady Poisson rate at or above one request per pass is a queue that never drains:
        # every latency would grow with the run's length, whatever the policy.
        prof = data.load_profile(profile, gpu.merge_online_us, gpu.sm_count)
        pass_s = request_alone_s(prof, gpu.host_per_kernel_s)
        if rps * pass_s >= 1.0:
            raise r.err(
                p + "rps",
                f"{rps:g} requests/s of {pass_s * 1e3:.2f} ms passes is a load of "
                f"{rps * pass_s:.2f}: the server would fall behind even alone; "
                f"give rps below {1.0 / pass_s:.1f} (or a load below 1)",
            )
    spec = OnlineSpec(
        name=r.string(t, p, "name", required=True),
        profile=profile,
        gpu=r.gpu_index(t, p, gpu),
        arrivals=arrivals,  # type: ignore[arg-type]
        load=load,
        rps=rps,
        trace=trace,
        trace_start_s=r.duration(t, p, "trace_start", default=0.0),
        trace_speedup=r.number(t, p, "trace_speedup", 1.0, 1e-6, 1e6),
        bin_s=r.duration(t, p, "bin", default=1.0, above=0.0),
        sm_pct=r.number(t, p, "sm_pct", 100.0, 1.0, 100.0),
        mem_bytes=r.size(t, p, "mem", default=2 << 30),
        slo_p99_ms=r.opt_number(t, p, "slo_p99_ms", 0.0, 1e9),
        slo_factor=r.number(t, p, "slo_factor", 1.1, 1.0, 1000.0),
        burst=r.burst(t, p) if arrivals == "poisson" else None,
        launch_blocking=r.boolean(t, p, "launch_blocking", default=False),
        request_boundaries=r.boolean(t, p, "request_boundaries", default=True),
    )
    if "burst" in t and arrivals != "poisson":
        raise ScenarioError(r.file, p + "burst", "a burst applies to poisson arrivals only")
    return spec


def _offline(r: _Reader, t: Mapping[str, Any], p: str, gpu: GpuSpec) -> OfflineSpec:
    r.keys(
        t,
        p,
        {
            "name", "profile", "gpu", "mem", "pinned_mem", "restartable", "submit",
            "launch_blocking", "queue", "checkpoint_on_signal", "checkpoint_interval",
            "restart_cost",
        },
    )  # fmt: skip
    queue = r.string(t, p, "queue", default="auto")
    if queue not in QUEUE_MODES:
        raise ScenarioError(
            r.file, p + "queue", f"expected one of {', '.join(QUEUE_MODES)}, got {queue!r}"
        )
    pinned = r.size(t, p, "pinned_mem", default=None) if "pinned_mem" in t else None
    return OfflineSpec(
        name=r.string(t, p, "name", required=True),
        profile=r.profile(t, p, gpu.merge_offline_us, gpu.sm_count),
        gpu=r.gpu_index(t, p, gpu),
        mem_bytes=r.size(t, p, "mem", default=4 << 30),
        pinned_mem_bytes=pinned,
        restartable=r.boolean(t, p, "restartable", default=True),
        submit_s=r.duration(t, p, "submit", default=1.0),
        launch_blocking=r.boolean(t, p, "launch_blocking", default=False),
        queue=queue,
        # Issue 32: what a restart loses (gpushare.sim.checkpoint).
        checkpoint_on_signal=r.boolean(t, p, "checkpoint_on_signal", default=True),
        checkpoint_interval_s=(
            r.duration(t, p, "checkpoint_interval", default=0.0, above=0.0)
            if "checkpoint_interval" in t
            else None
        ),
        restart_cost_s=(
            r.duration(t, p, "restart_cost", default=0.0) if "restart_cost" in t else None
        ),
    )


class _Reader:
    """Typed access to TOML values that raises :class:`ScenarioError` naming the key."""

    def __init__(self, file: Path | str | None) -> None:
        self.file = file

    def err(self, key: str, reason: str, value: Any = None) -> ScenarioError:
        shown = f", got {value!r}" if value is not None else ""
        return ScenarioError(self.file, key, reason + shown)

    def keys(self, t: Mapping[str, Any], p: str, valid: set[str]) -> None:
        for key in t:
            if key not in valid:
                raise self.err(p + key, f"unknown key; valid keys here: {', '.join(sorted(valid))}")

    def table(self, t: Mapping[str, Any], key: str, *, required: bool = False) -> Mapping[str, Any]:
        v = t.get(key)
        if v is None:
            if required:
                raise self.err(key, f"missing table [{key}]")
            return {}
        if not isinstance(v, Mapping):
            raise self.err(key, "expected a table", v)
        return v

    def array(self, t: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
        v = t.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, Mapping) for x in v):
            raise self.err(key, f"expected an array of tables ([[{key}]])")
        return v

    def string(
        self,
        t: Mapping[str, Any],
        p: str,
        key: str,
        *,
        default: str | None = None,
        required: bool = False,
    ) -> str:
        v = t.get(key)
        if v is None:
            if required or default is None:
                raise self.err(p + key, "missing; give a string")
            return default
        if not isinstance(v, str) or (required and not v):
            raise self.err(p + key, "expected a non-empty string", v)
        return v

    def opt_string(self, t: Mapping[str, Any], p: str, key: str) -> str | None:
        return self.string(t, p, key) if key in t else None

    def integer(
        self,
        t: Mapping[str, Any],
        p: str,
        key: str,
        *,
        default: int,
        low: int = 0,
        high: int = 2**62,
    ) -> int:
        v = t.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
            raise self.err(p + key, f"expected an integer in [{low}, {high}]", v)
        return v

    def number(
        self, t: Mapping[str, Any], p: str, key: str, default: float, low: float, high: float
    ) -> float:
        v = t.get(key, default)
        if not isinstance(v, int | float) or isinstance(v, bool) or not low <= v <= high:
            raise self.err(p + key, f"expected a number in [{low}, {high}]", v)
        return float(v)

    def opt_number(
        self, t: Mapping[str, Any], p: str, key: str, low: float, high: float
    ) -> float | None:
        if key not in t:
            return None
        v = self.number(t, p, key, 0.0, low, high)
        if v <= low:
            raise self.err(p + key, f"must be above {low}", v)
        return v

    def load(self, t: Mapping[str, Any], p: str) -> float | None:
        """The offered load (arrival rate x pass time alone): a number in (0, 1)."""
        if "load" not in t:
            return None
        v = t["load"]
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise self.err(p + "load", "expected a number above 0 and below 1", v)
        if v <= 0:
            raise self.err(p + "load", "must be above 0 (a fraction of one server's capacity)", v)
        if v >= 1:
            raise self.err(
                p + "load",
                "must be below 1: at a load of 1 or more the server falls behind even alone, "
                "so every latency grows with the run's length; give e.g. 0.5",
                v,
            )
        return float(v)

    def boolean(self, t: Mapping[str, Any], p: str, key: str, *, default: bool) -> bool:
        v = t.get(key, default)
        if not isinstance(v, bool):
            raise self.err(p + key, "expected true or false", v)
        return v

    def duration(
        self, t: Mapping[str, Any], p: str, key: str, *, default: float, above: float | None = None
    ) -> float:
        v = t.get(key)
        if v is None:
            return default
        bad_type = isinstance(v, bool) or not isinstance(v, str | int | float)
        try:
            s = parse_duration("bad" if bad_type else v)
        except ValueError:
            raise self.err(
                p + key, "expected a duration such as '30s', '100ms' or 2.5", v
            ) from None
        if s < 0 or (above is not None and s <= above):
            raise self.err(p + key, "must be a positive duration", v)
        return s

    def size(self, t: Mapping[str, Any], p: str, key: str, *, default: int | None) -> Any:
        v = t.get(key)
        if v is None:
            return default
        bad_type = isinstance(v, bool) or not isinstance(v, str | int)
        try:
            return parse_size("bad" if bad_type else v)
        except ValueError:
            raise self.err(p + key, "expected a size such as '4GiB' or '512MiB'", v) from None

    def burst(self, t: Mapping[str, Any], p: str) -> tuple[float, float, float] | None:
        v = t.get("burst")
        if v is None:
            return None
        ok = isinstance(v, list) and len(v) == 3
        nums = [parse_duration(x) if isinstance(x, str) else x for x in v] if ok else []
        if not ok or not all(
            isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in nums
        ):
            raise self.err(p + "burst", 'expected ["AT", "FOR", FACTOR], e.g. ["20s", "15s", 3]', v)
        at, length, factor = (float(x) for x in nums)
        if length <= 0 or factor <= 0:
            raise self.err(p + "burst", "the burst's length and factor must be positive", v)
        return (at, length, factor)

    def gpu_index(self, t: Mapping[str, Any], p: str, gpu: GpuSpec) -> int:
        return self.integer(t, p, "gpu", default=0, low=0, high=gpu.count - 1)

    def data_file(self, key: str, relative: str) -> Path:
        try:
            return data.resolve(relative)
        except data.DataError as exc:
            raise self.err(
                key, f"{exc}; names are relative to gpushare's data folder or ${data.DATA_ENV}"
            ) from exc

    def profile(self, t: Mapping[str, Any], p: str, merge_us: float, sm_count: int) -> str:
        rel = self.string(t, p, "profile", required=True)
        self.data_file(p + "profile", rel)
        try:
            data.load_profile(rel, merge_us, sm_count)
        except data.DataError as exc:
            raise self.err(p + "profile", str(exc)) from exc
        return rel
