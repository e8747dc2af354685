"""Scenario files: what runs on the simulated node, as TOML validated with clear errors.

A scenario names a node (GPUs), online services (a forward-pass profile and an arrival process),
offline jobs (a training-iteration profile) and optional overrides of gpushare's ``[control]``,
``[probe]`` and ``[latency]`` tables (same keys as ``gpushare.toml``). Data files are named relative
to gpushare's data folder (:func:`gpushare.sim.data.resolve`). Every bad value raises
:class:`ScenarioError` naming the file, the key and the fix: the tables are read by
:mod:`gpushare.tomlschema`, as the config's are. See ``gpushare/scenarios/README.md``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from gpushare import config as gconfig
from gpushare.sim import data
from gpushare.sim.gpu import DEFAULT_SLICE_S, DEFAULT_SWITCH_S
from gpushare.sim.inflight import DEFAULT_INFLIGHT_WAKE_S
from gpushare.sim.llm_smshare import FITTED_S_SAT
from gpushare.sim.workloads import DEFAULT_HOST_PER_KERNEL_S, request_alone_s
from gpushare.tomlschema import Reader, TomlError, duration, num, show, size, type_name
from gpushare.units import parse_duration

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

ArrivalKind = Literal["poisson", "azure", "genai"]
QueueMode = Literal["shallow", "deep", "auto"]


class ScenarioError(TomlError):
    """A scenario file is bad; the message names the file, the key and the fix."""

    unnamed = "<scenario>"


def _read(hook: Callable[[Reader, Any, str], Any]) -> dict[str, Any]:
    # The field's value is read by ``hook`` (resolved when called: hooks are defined below).
    return {"read": lambda r, v, k: hook(r, v, k)}


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """The simulated GPUs of the node (all alike) and the model's calibrated constants."""

    count: int = num(1, minimum=1, maximum=64)
    sm_count: int = num(80, minimum=1, maximum=1024)
    mem_total_bytes: int = size(16 << 30, minimum=1)
    parallel_fraction: float = num(0.95, minimum=0.0, maximum=1.0)
    bw_beta: float = num(0.6, minimum=0.0, maximum=10.0)
    slice_s: float = duration(DEFAULT_SLICE_S, above=True)
    switch_s: float = duration(DEFAULT_SWITCH_S)
    wave_scale: float = num(1.0, minimum=0.05, maximum=20.0)
    launch_gap_s: float = duration(10e-6)
    #: Bounded in-flight mode (``GPUSHARE_MAX_INFLIGHT``): a freed slot to the next launch on the
    #: GPU (W3b).
    inflight_wake_s: float = duration(DEFAULT_INFLIGHT_WAKE_S)
    host_per_kernel_s: float = duration(DEFAULT_HOST_PER_KERNEL_S)
    #: A training job's CPU time per source kernel (W3: 0, hidden behind a deep queue); a
    #: sensitivity for shallow queues, which hide it only within their bound (W3b).
    train_host_per_kernel_s: float = duration(0.0)
    merge_online_us: float = num(data.DEFAULT_MERGE_ONLINE_US, minimum=0.0, maximum=10_000.0)
    merge_offline_us: float = num(data.DEFAULT_MERGE_OFFLINE_US, minimum=0.0, maximum=10_000.0)
    start_s: float = duration(1.0)
    #: A relaunch's start-up (issue 32: a real training job takes 30 s to minutes; was 5 s).
    restart_s: float = duration(60.0)
    probe_kernel_s: float = duration(15e-6, above=True)


@dataclass(frozen=True, slots=True)
class OnlineSpec:
    """An online service: requests of one forward pass, open loop."""

    name: str
    profile: str
    gpu: int = num(0, minimum=0, maximum=63)
    arrivals: ArrivalKind = "poisson"
    #: The offered load (arrival rate x pass time alone), in (0, 1); ``None`` when ``rps`` is given.
    load: float | None = field(default=0.5, metadata=_read(lambda r, v, k: _load(r, v, k)))
    rps: float | None = num(None, minimum=0.0, maximum=100_000.0, above=True)
    trace: str | None = None
    trace_start_s: float = duration(0.0)
    trace_speedup: float = num(1.0, minimum=1e-6, maximum=1e6)
    bin_s: float = duration(1.0, above=True)
    sm_pct: float = num(100.0, minimum=1.0, maximum=100.0)
    mem_bytes: int = size(2 << 30)
    slo_p99_ms: float | None = num(None, minimum=0.0, maximum=1e9, above=True)
    slo_factor: float = num(1.1, minimum=1.0, maximum=1000.0)
    #: Poisson only: ``(at_s, for_s, factor)``, the rate times ``factor`` for a while.
    burst: tuple[float, float, float] | None = field(
        default=None, metadata=_read(lambda r, v, k: _burst(r, v, k))
    )
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
    gpu: int = num(0, minimum=0, maximum=63)
    mem_bytes: int = size(4 << 30)
    pinned_mem_bytes: int | None = field(default=None, metadata={"kind": "size", "min": 0})
    restartable: bool = True
    submit_s: float = duration(1.0)
    launch_blocking: bool = False
    #: ``gpushare submit --queue``: ``auto`` (shallow while the GPU's request gating is on),
    #: ``shallow`` (``CUDA_LAUNCH_BLOCKING=1``) or ``deep``; by default what a submit without
    #: ``--queue`` is recorded with, :data:`gpushare.model.DEFAULT_OFFLINE_QUEUE` (issue 32).
    queue: QueueMode = "auto"
    #: Issue 32 (gpushare.sim.checkpoint): whether the job saves its state when signalled, and
    #: otherwise how often it checkpoints (``None``: never; a restart loses its whole run).
    checkpoint_on_signal: bool = True
    checkpoint_interval_s: float | None = field(
        default=None, metadata={"kind": "duration", "min": 0.0, "above": True}
    )
    #: ``submit --restart-cost`` (issue 32); ``None``: the controller's ``restart_cost``.
    restart_cost_s: float | None = field(
        default=None, metadata={"kind": "duration", "min": 0.0, "above": False}
    )


@dataclass(frozen=True, slots=True)
class LlmSpec:
    """An LLM inference server (:mod:`gpushare.sim.llm`): Llama-2-7B on a V100-32GB roof.

    Requests replay the shipped Azure conversation trace from ``trace_start``, thinned to
    ``load`` x the server's capacity alone. Its TTFT and TPOT SLOs are given, or ``slo_factor``
    x its p99s alone; the daemon sees its token timings as ``client.report_ttft`` /
    ``report_tpot`` send them: once per request, its mean TPOT (``tpot_report = "request"``, the
    default: the TPOT an SLO is scored on), or per token the gap (``"token"``) or the sequence's
    mean so far (``"running"``).
    """

    name: str
    gpu: int = num(0, minimum=0, maximum=63)
    #: A fraction of the server's capacity alone (``llm_pairs.capacity_rps``), in (0, 1).
    load: float = field(default=0.5, metadata=_read(lambda r, v, k: _load(r, v, k)))
    trace_start_s: float = duration(600.0)
    slo_ttft_p99_s: float | None = field(
        default=None, metadata={"kind": "duration", "min": 0.0, "above": True}
    )
    slo_tpot_p99_s: float | None = field(
        default=None, metadata={"kind": "duration", "min": 0.0, "above": True}
    )
    slo_factor: float = num(1.5, minimum=1.0, maximum=1000.0)
    kv_cache_bytes: int = size(6 << 30, minimum=1 << 20)
    max_batched_tokens: int = num(2048, minimum=16, maximum=1 << 20)
    max_seqs: int = num(256, minimum=1, maximum=1 << 16)
    tpot_report: Literal["token", "running", "request"] = "request"
    #: Its MPS active-thread percentage, as ``submit --online --sm`` gives it.
    sm_pct: float = num(100.0, minimum=1.0, maximum=100.0)
    #: The saturating law's fraction for its kernels on fewer SMs (docs/simulator.md L3b; default
    #: the measured one); 0: G7.
    s_sat: float = num(FITTED_S_SAT, minimum=0.0, maximum=1.0)


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
    #: LLM servers (``[[llm]]``).
    llm: tuple[LlmSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class _Head:
    """The ``[scenario]`` table."""

    name: str | None = None
    description: str = ""
    duration_s: float = duration(30.0, above=True)
    warmup_s: float = duration(2.0)
    seed: int = num(1, minimum=0, maximum=2**62)


def _raw(r: Reader, value: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        r.fail(key, f"expected a table, got {type_name(value)}")
    return value


@dataclass(frozen=True, slots=True)
class _Document:
    """A scenario file as written; ``[control]``, ``[probe]`` and ``[latency]`` are the config's."""

    scenario: _Head
    gpu: GpuSpec = field(default_factory=GpuSpec)
    online: tuple[OnlineSpec, ...] = field(
        default=(), metadata=_read(lambda r, v, k: r.tables(OnlineSpec, v, k))
    )
    offline: tuple[OfflineSpec, ...] = field(
        default=(), metadata=_read(lambda r, v, k: r.tables(OfflineSpec, v, k))
    )
    llm: tuple[LlmSpec, ...] = field(
        default=(), metadata=_read(lambda r, v, k: r.tables(LlmSpec, v, k))
    )
    control: Mapping[str, Any] = field(default_factory=dict, metadata=_read(_raw))
    probe: Mapping[str, Any] = field(default_factory=dict, metadata=_read(_raw))
    latency: Mapping[str, Any] = field(default_factory=dict, metadata=_read(_raw))


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
    r = Reader(file, ScenarioError)
    if "scenario" not in doc:
        r.fail("scenario", "missing table [scenario]")
    top: _Document = r.table(_Document, doc, "")
    head = top.scenario
    if head.warmup_s >= head.duration_s:
        r.fail("scenario.warmup", "must be shorter than scenario.duration")
    gpu = top.gpu
    raw_online = doc.get("online", [])
    online = tuple(
        _online(r, spec, f"online[{i}].", gpu, raw_online[i]) for i, spec in enumerate(top.online)
    )
    offline = tuple(_offline(r, spec, f"offline[{i}].", gpu) for i, spec in enumerate(top.offline))
    for i, spec in enumerate(top.llm):
        if not spec.name:
            r.fail(f"llm[{i}].name", "expected a non-empty string")
        if spec.gpu >= gpu.count:
            r.fail(f"llm[{i}].gpu", f"expected an integer in [0, {gpu.count - 1}], got {spec.gpu}")
    if not online and not offline and not top.llm:
        r.fail("", "a scenario needs at least one [[online]], [[llm]] or [[offline]]")
    names = [s.name for s in online] + [s.name for s in top.llm] + [s.name for s in offline]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        r.fail("name", f"client names must be unique; repeated: {dup}")
    overrides = {k: doc[k] for k in ("control", "probe", "latency") if k in doc}
    try:
        cfg = gconfig.from_dict(overrides, file)
    except gconfig.ConfigError as exc:
        raise ScenarioError(file, exc.key, exc.reason) from exc
    return Scenario(
        name=head.name if head.name is not None else Path(str(file or "scenario")).stem,
        file=str(file or "<scenario>"),
        description=head.description,
        duration_s=head.duration_s,
        warmup_s=head.warmup_s,
        seed=head.seed,
        gpu=gpu,
        online=online,
        offline=offline,
        config=cfg,
        llm=top.llm,
    )


def _online(
    r: Reader, spec: OnlineSpec, p: str, gpu: GpuSpec, raw: Mapping[str, Any]
) -> OnlineSpec:
    """The checks of one ``[[online]]`` that need more than its own keys."""
    if spec.rps is not None:
        if "load" in raw:
            r.fail(p + "rps", "give either rps or load, not both")
        spec = replace(spec, load=None)
    if spec.arrivals != "poisson" and spec.trace is None:
        r.fail(p + "trace", f"arrivals = '{spec.arrivals}' needs a trace file")
    if spec.trace is not None:
        _data_file(r, p + "trace", spec.trace)
    _check_common(r, spec.name, spec.profile, spec.gpu, p, gpu, gpu.merge_online_us)
    if spec.arrivals == "poisson" and spec.rps is not None:
        # A steady Poisson rate at or above one request per pass is a queue that never drains:
        # every latency would grow with the run's length, whatever the policy.
        prof = data.load_profile(spec.profile, gpu.merge_online_us, gpu.sm_count)
        pass_s = request_alone_s(prof, gpu.host_per_kernel_s)
        rps = spec.rps
        if rps * pass_s >= 1.0:
            r.fail(
                p + "rps",
                f"{rps:g} requests/s of {pass_s * 1e3:.2f} ms passes is a load of "
                f"{rps * pass_s:.2f}: the server would fall behind even alone; "
                f"give rps below {1.0 / pass_s:.1f} (or a load below 1)",
            )
    if spec.burst is not None and spec.arrivals != "poisson":
        r.fail(p + "burst", "a burst applies to poisson arrivals only")
    return spec


def _offline(r: Reader, spec: OfflineSpec, p: str, gpu: GpuSpec) -> OfflineSpec:
    """The checks of one ``[[offline]]`` that need more than its own keys."""
    _check_common(r, spec.name, spec.profile, spec.gpu, p, gpu, gpu.merge_offline_us)
    return spec


def _check_common(
    r: Reader, name: str, profile: str, index: int, p: str, gpu: GpuSpec, merge_us: float
) -> None:
    if not name:
        r.fail(p + "name", "expected a non-empty string")
    if not profile:
        r.fail(p + "profile", "expected a non-empty string")
    if index >= gpu.count:
        r.fail(p + "gpu", f"expected an integer in [0, {gpu.count - 1}], got {index!r}")
    _data_file(r, p + "profile", profile)
    try:
        data.load_profile(profile, merge_us, gpu.sm_count)
    except data.DataError as exc:
        raise ScenarioError(r.file, p + "profile", str(exc)) from exc


def _data_file(r: Reader, key: str, relative: str) -> Path:
    try:
        return data.resolve(relative)
    except data.DataError as exc:
        raise ScenarioError(
            r.file, key, f"{exc}; names are relative to gpushare's data folder or ${data.DATA_ENV}"
        ) from exc


def _load(r: Reader, v: Any, key: str) -> float:
    """The offered load (arrival rate x pass time alone): a number in (0, 1)."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        r.fail(key, f"expected a number above 0 and below 1, got {show(v)}")
    if v <= 0:
        r.fail(key, f"must be above 0 (a fraction of one server's capacity), got {show(v)}")
    if v >= 1:
        r.fail(
            key,
            "must be below 1: at a load of 1 or more the server falls behind even alone, "
            f"so every latency grows with the run's length; give e.g. 0.5, got {show(v)}",
        )
    return float(v)


def _burst(r: Reader, v: Any, key: str) -> tuple[float, float, float]:
    ok = isinstance(v, list) and len(v) == 3
    try:
        nums = [parse_duration(x) if isinstance(x, str) else x for x in v] if ok else []
    except ValueError:
        nums = []
    if not nums or not all(
        isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in nums
    ):
        r.fail(key, f'expected ["AT", "FOR", FACTOR], e.g. ["20s", "15s", 3], got {show(v)}')
    at, length, factor = (float(x) for x in nums)
    if length <= 0 or factor <= 0:
        r.fail(key, f"the burst's length and factor must be positive, got {show(v)}")
    return (at, length, factor)
