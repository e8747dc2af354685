"""The GPU model against published measurements: the validation table of ``docs/simulator.md``.

Each point is a measurement someone published (``gpushare/data/validation/``,
``gpushare/data/igniter-v100/``, ``gpushare/data/orion-v100-kernels/``) and a small simulation
of the same set-up. Points are either *calibration* points (a constant of the model was chosen
from them) or *validation* points (nothing was fitted to them). ``bench/sim_validation.py``
prints the table; ``tests/sim/test_sim_validation.py`` holds each point to its stated tolerance.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass

from gpushare.sim import data
from gpushare.sim.arrivals import poisson_arrivals
from gpushare.sim.gpu import DEFAULT_SLICE_S, EventLoop, Gpu, GpuMode, ShareRule
from gpushare.sim.workloads import (
    DEFAULT_HOST_PER_KERNEL_S,
    OfflineTrainer,
    OnlineServer,
    request_alone_s,
)
from gpushare.stats import percentile

ORION = "orion-v100-kernels"
POINTS = "validation/points.csv"
#: Published standalone latencies of eager inference passes (the host cost, W3).
STANDALONE = "validation/standalone.csv"
IGNITER = "igniter-v100/latency_vs_mps_thread_pct.csv"
#: The iGniter curves the run-time law's parallel fraction was fitted on (G7).
IGNITER_CALIBRATION = (("resnet50", 32), ("vgg19", 16), ("alexnet", 64))


@dataclass(frozen=True, slots=True)
class Point:
    """One published measurement of several identical clients sharing a GPU."""

    id: str
    sharing: str
    gpu: str
    sms: int
    workload: str
    clients: int
    measured_alone: float
    measured_shared: float
    unit: str
    metric: str
    source: str

    @property
    def ratio(self) -> float:
        """Shared over alone, as measured."""
        return self.measured_shared / self.measured_alone


def load_points() -> dict[str, Point]:
    """The published co-location points, by id."""
    out: dict[str, Point] = {}
    with data.resolve(POINTS).open(newline="") as fh:
        for row in csv.DictReader(fh):
            out[row["id"]] = Point(
                id=row["id"],
                sharing=row["sharing"],
                gpu=row["gpu"],
                sms=int(row["sms"]),
                workload=row["workload"],
                clients=int(row["clients"]),
                measured_alone=float(row["measured_alone"]),
                measured_shared=float(row["measured_shared"]),
                unit=row["unit"],
                metric=row["metric"],
                source=row["source"],
            )
    return out


def switch_cost_from(points: list[Point], slice_s: float = DEFAULT_SLICE_S) -> float:
    """The context-switch cost that explains time-slicing points of N saturated clients.

    Under time-slicing each of N clients that always have work gets one slice in N, and every
    slice costs a switch, so its time shared is ``N x (1 + switch / slice)`` its time alone:
    the switch cost is ``slice x mean(ratio / N - 1)`` over the points.
    """
    return slice_s * statistics.fmean(p.ratio / p.clients - 1.0 for p in points)


@dataclass(frozen=True, slots=True)
class StandalonePoint:
    """A published latency of one inference pass alone, for a profile the model has."""

    id: str
    role: str  # "calibration" or "validation"
    profile: str
    gpu: str
    framework: str
    measured_ms: float
    #: How far the model may be off this point (its test and the table say the same).
    tolerance_pct: float
    metric: str
    comparability: str
    source: str


def load_standalone() -> dict[str, StandalonePoint]:
    """The published standalone latencies, by id."""
    with data.resolve(STANDALONE).open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    return {
        r["id"]: StandalonePoint(
            **{  # type: ignore[arg-type]
                **r,
                "measured_ms": float(r["measured_ms"]),
                "tolerance_pct": float(r["tolerance_pct"]),
            }
        )
        for r in rows
    }


def alone_ms(profile: str, host_per_kernel_s: float) -> float:
    """The model's latency of one pass of an Orion profile alone, at a host cost per kernel."""
    prof = data.load_profile(f"{ORION}/{profile}.csv")
    return request_alone_s(prof, host_per_kernel_s) * 1e3


def host_cost_for(point: StandalonePoint) -> float:
    """The host cost per kernel at which the model's pass alone takes the measured time.

    The pass's time alone grows with the host cost (:func:`request_alone_s`), so a bisection
    finds it; a measurement at or under the kernel time alone needs none (0).
    """
    lo, hi = 0.0, 1e-3
    if alone_ms(point.profile, lo) >= point.measured_ms:
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if alone_ms(point.profile, mid) < point.measured_ms:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def host_cost_from(points: list[StandalonePoint]) -> float:
    """The calibrated host cost per kernel: the mean of what each calibration point needs."""
    return statistics.fmean(host_cost_for(p) for p in points)


def _mean_pass_s(
    loop: EventLoop, gpu: Gpu, profile: data.KernelProfile, clients: int, iterations: int
) -> float:
    """Mean time of one pass when ``clients`` copies of a profile run back to back on ``gpu``."""
    jobs = []
    for k in range(clients):
        job = OfflineTrainer(f"c{k}", gpu, profile, sm_pct=100, mem_bytes=0)
        job.priority = 0
        job.start(0.0)
        jobs.append(job)
    loop.run_until(profile.total_s * clients * 4.0 * iterations)
    per_pass = []
    for job in jobs:
        assert len(job.iterations) >= iterations, "horizon too short for the requested passes"
        per_pass.append(job.iterations[iterations - 1] / iterations)
    return statistics.fmean(per_pass)


def closed_loop_ratio(
    profile: data.KernelProfile,
    clients: int,
    *,
    mode: GpuMode,
    sm_count: int,
    iterations: int = 3,
    **gpu: float,
) -> float:
    """Mean time of a pass when ``clients`` copies run back to back, over the time alone."""
    loop = EventLoop()
    g = Gpu(loop, uuid="GPU-val", index=0, sm_count=sm_count, mode=mode, **gpu)  # type: ignore[arg-type]
    return _mean_pass_s(loop, g, profile, clients, iterations) / profile.total_s


def throughput_gain(
    profile: data.KernelProfile,
    clients: int,
    *,
    mode: GpuMode,
    sm_count: int,
    iterations: int = 10,
    share: ShareRule = "fifo",
    wave_scale: float = 1.0,
) -> float:
    """Aggregate passes per second of ``clients`` back-to-back copies over one copy alone."""
    loop = EventLoop()
    g = Gpu(
        loop,
        uuid="GPU-val",
        index=0,
        sm_count=sm_count,
        mode=mode,
        share=share,
        wave_scale=wave_scale,
    )
    return clients * profile.total_s / _mean_pass_s(loop, g, profile, clients, iterations)


def spin_kernel(seconds: float) -> data.KernelProfile:
    """One kernel of one block (a single thread spinning), as in the T4 test program."""
    return data.merge_kernels([(seconds * 1e6, 1, 0.0, 1)], 0.0, "spin", 40)


@dataclass(frozen=True, slots=True)
class OrionRun:
    """The model's run of Orion's plain-MPS co-location point."""

    p50_ms: float
    p99_ms: float
    train_it_s: float


def orion_point(
    seed: int = 1,
    *,
    end_s: float = 20.0,
    share: ShareRule = "fifo",
    wave_scale: float = 1.0,
    host_per_kernel_s: float = DEFAULT_HOST_PER_KERNEL_S,
) -> OrionRun:
    """ResNet-50 b4 inference at Poisson 30 rps next to ResNet-50 b32 training, plain MPS, V100."""
    loop = EventLoop()
    gpu = Gpu(loop, uuid="GPU-val", index=0, share=share, wave_scale=wave_scale)
    fwd = data.load_profile(f"{ORION}/resnet50_4_fwd.csv")
    arrivals = poisson_arrivals(30.0, seed, end_s)
    server = OnlineServer("inf", gpu, fwd, arrivals, sm_pct=100, mem_bytes=0)
    server.set_host_cost(host_per_kernel_s)
    gpu.attach(server)
    server.start(loop)
    fb = data.load_profile(f"{ORION}/resnet50_32_fb1.csv", data.DEFAULT_MERGE_OFFLINE_US)
    train = OfflineTrainer("train", gpu, fb, sm_pct=100, mem_bytes=0)
    train.priority = 0  # plain MPS: no client priority
    train.start(0.0)
    loop.run_until(end_s)
    lats = [lat * 1e3 for arr, lat in server.completed if arr >= 1.0]
    its = len([t for t in train.iterations if t >= 1.0]) / (end_s - 1.0)
    return OrionRun(percentile(lats, 50), percentile(lats, 99), its)


@dataclass(frozen=True, slots=True)
class PairRun:
    """An inference server next to a training job: p99 on two latency metrics, in ms.

    ``latency`` is completion - arrival (the simulator's metric, W1: queueing included);
    ``service`` is completion - the moment the server took the request off its queue, queueing
    excluded (the latency ``tally-bench``'s ``ServerInferMonitor`` records).
    """

    latency_p99_ms: float
    service_p99_ms: float
    requests: int


def tally_pair(
    fwd: str,
    train: str | None,
    *,
    mode: GpuMode,
    load: float = 0.5,
    seed: int = 1,
    end_s: float = 10.0,
    warmup_s: float = 1.0,
    host_per_kernel_s: float = DEFAULT_HOST_PER_KERNEL_S,
) -> PairRun:
    """A Tally-shaped pair on the simulated V100: Poisson arrivals at ``load`` / pass time.

    ``train`` None runs the server alone (the reference). Under ``mode = "mps"`` the two share
    the GPU with no client priority (plain MPS).
    """
    loop = EventLoop()
    gpu = Gpu(loop, uuid="GPU-val", index=0, mode=mode)
    prof = data.load_profile(f"{ORION}/{fwd}.csv")
    arrivals = poisson_arrivals(load / request_alone_s(prof, host_per_kernel_s), seed, end_s)
    server = OnlineServer("inf", gpu, prof, arrivals, sm_pct=100, mem_bytes=0)
    server.set_host_cost(host_per_kernel_s)
    gpu.attach(server)
    server.start(loop)
    if train is not None:
        fb = data.load_profile(f"{ORION}/{train}.csv", data.DEFAULT_MERGE_OFFLINE_US)
        job = OfflineTrainer("train", gpu, fb, sm_pct=100, mem_bytes=0)
        job.priority = 0
        job.start(0.0)
    loop.run_until(end_s)
    lats = [lat * 1e3 for arr, lat in server.completed if arr >= warmup_s]
    served = [s * 1e3 for arr, s in server.served if arr >= warmup_s]
    return PairRun(percentile(lats, 99), percentile(served, 99), len(lats))


def orion_measured() -> OrionRun:
    """Orion's measured point (``mps_example_*``)."""
    path = data.resolve(f"{ORION}/mps_example_resnet50inf_resnet50train_V100.log.json")
    point = json.loads(path.read_text())
    return OrionRun(point["p50-latency-0"], point["p99-latency-0"], point["throughput-1"])


def igniter_curves() -> dict[tuple[str, int], dict[int, float]]:
    """IGniter's median compute time by (model, batch) and MPS thread percentage."""
    curves: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    with data.resolve(IGNITER).open(newline="") as fh:
        for row in csv.DictReader(fh):
            curves[(row["model"], int(row["batch"]))][int(row["thread_pct"])] = float(
                row["compute_ms_p50"]
            )
    return curves


def capped_pass_s(profile: str, pct: float) -> float:
    """One pass of a profile alone on the simulated V100 under an MPS thread percentage."""
    loop = EventLoop()
    gpu = Gpu(loop, uuid="GPU-val", index=0)
    merge = data.DEFAULT_MERGE_OFFLINE_US if "_fb1" in profile else data.DEFAULT_MERGE_ONLINE_US
    prof = data.load_profile(profile, merge)
    job = OfflineTrainer("job", gpu, prof, sm_pct=pct, mem_bytes=0)
    job.start(0.0)
    loop.run_until(prof.total_s * 20)
    return job.iterations[0]


def igniter_worst_error(model: str, batch: int, profile: str) -> float:
    """The model's slowdown under a cap against iGniter's, worst relative error over 10..90 %."""
    curve = igniter_curves()[(model, batch)]
    full = capped_pass_s(profile, 100)
    worst = 0.0
    for pct in range(10, 100, 10):
        err = (capped_pass_s(profile, pct) / full) / (curve[pct] / curve[100]) - 1.0
        if abs(err) > abs(worst):
            worst = err
    return worst


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the validation table."""

    id: str
    role: str  # "calibration" or "validation"
    what: str
    measured: float
    model: float
    tolerance: str

    @property
    def error(self) -> float:
        """Model over measured, minus one."""
        return self.model / self.measured - 1.0


def table(*, orion_seeds: tuple[int, ...] = (1, 2, 3)) -> list[Row]:
    """Every point, measured against modelled (a few seconds of CPU per Orion seed)."""
    pts = load_points()
    return [
        *_igniter_rows(),
        *_standalone_rows(),
        *_orion_rows(orion_seeds),
        *_sharing_rows(pts),
    ]


def _igniter_rows() -> list[Row]:
    """Thread-percentage curves from iGniter: calibration batches, then the held-out one."""
    rows: list[Row] = []
    for model, batch in IGNITER_CALIBRATION:
        err = igniter_worst_error(model, batch, f"{ORION}/resnet50_32_fb1.csv")
        rows.append(
            Row(
                f"igniter-{model}-b{batch}",
                "calibration",
                f"iGniter V100 {model} b{batch}: time at 10-90 % threads over 100 % (worst point)",
                1.0,
                1.0 + err,
                "6 %",
            )
        )
    err = igniter_worst_error("resnet50", 4, f"{ORION}/resnet50_4_fwd.csv")
    rows.append(
        Row(
            "igniter-resnet50-b4",
            "validation",
            "iGniter V100 resnet50 b4: time at 10-90 % threads over 100 % (worst point)",
            1.0,
            1.0 + err,
            "-25 % .. +5 %",
        )
    )
    return rows


def _standalone_rows() -> list[Row]:
    """Published single-model latencies against the model alone."""
    rows: list[Row] = []
    for sp in load_standalone().values():
        rows.append(
            Row(
                sp.id,
                sp.role,
                f"{sp.gpu}, {sp.framework}, {sp.profile}: {sp.metric} (ms)",
                sp.measured_ms,
                alone_ms(sp.profile, DEFAULT_HOST_PER_KERNEL_S),
                f"{sp.tolerance_pct:g} %",
            )
        )
    return rows


def _orion_rows(orion_seeds: tuple[int, ...]) -> list[Row]:
    """Orion's plain-MPS pair, the mean over ``orion_seeds``."""
    rows: list[Row] = []
    runs = [orion_point(s) for s in orion_seeds]
    real = orion_measured()
    for attr, what, tol in (
        ("p50_ms", "Orion V100 plain MPS, ResNet-50 b4 at 30 rps + b32 training: p50 ms", "x3.5"),
        ("p99_ms", "same: inference p99 ms", "x2"),
        ("train_it_s", "same: training it/s", "15 %"),
    ):
        rows.append(
            Row(
                f"orion-mps-{attr.split('_')[0]}",
                "validation",
                what,
                getattr(real, attr),
                statistics.fmean(getattr(r, attr) for r in runs),
                tol,
            )
        )
    return rows


def _sharing_rows(pts: dict[str, Point]) -> list[Row]:
    """Time-slicing and MPS points of several clients (nos, T4, TRTLab)."""
    rows: list[Row] = []
    ts = [pts[k] for k in ("nos-ts-3", "nos-ts-5", "nos-ts-7")]
    proxy = data.load_profile(f"{ORION}/transformer_xl_4_fwd.csv")
    for p in ts:
        rows.append(
            Row(
                p.id,
                "calibration",
                f"{p.gpu}, {p.clients} x {p.workload}, time-slicing: time over alone",
                p.ratio,
                closed_loop_ratio(proxy, p.clients, mode="time_slice", sm_count=p.sms),
                "3 %",
            )
        )
    for key, mode in (("t4-ts-5", "time_slice"), ("t4-mps-5", "mps")):
        p = pts[key]
        rows.append(
            Row(
                p.id,
                "validation",
                f"{p.gpu}, {p.clients} x {p.workload}, {p.sharing}: time over alone",
                p.ratio,
                closed_loop_ratio(
                    spin_kernel(p.measured_alone),
                    p.clients,
                    mode=mode,  # type: ignore[arg-type]
                    sm_count=p.sms,
                    iterations=1,
                ),
                "15 %",
            )
        )
    # Eight TensorRT ResNet-50 b1 servers on a V100, each one request at a time, saturated by an
    # asynchronous client; the kernels are Orion's PyTorch ResNet-50 b4 pass (a proxy: the TensorRT
    # b1 engine's kernels are not published), so the MPS point checks co-residency of narrow
    # inference kernels, not this engine's exact grids.
    r50 = data.load_profile(f"{ORION}/resnet50_4_fwd.csv")
    for key, mode, tol in (("trtlab-ts-8", "time_slice", "10 %"), ("trtlab-mps-8", "mps", "x1.5")):
        p = pts[key]
        rows.append(
            Row(
                p.id,
                "validation",
                f"{p.gpu}, {p.clients} x {p.workload}, {p.sharing}: throughput over one alone",
                p.ratio,
                throughput_gain(r50, p.clients, mode=mode, sm_count=p.sms),  # type: ignore[arg-type]
                tol,
            )
        )
    return rows
