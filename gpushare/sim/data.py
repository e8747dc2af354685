"""The simulator's data: kernel profiles and arrival traces, shipped in the package.

Scenario files name data files relative to the package's data folder (``gpushare/data``, found with
:mod:`importlib.resources`, so it works from a clone and from an installed wheel alike), e.g.
``orion-v100-kernels/resnet50_4_fwd.csv``. ``$GPUSHARE_SIM_DATA`` names a folder of the user's own
profiles and traces that is searched first; absolute paths are used as they are. A name may be
stored compressed as ``NAME.gz``. The loaders read both the shipped (reduced) files and the
upstream formats (``gpushare/data/README.md``). Loaded profiles and traces are cached per process
because every policy run of a scenario reads the same files.
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
import math
import os
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import TextIO

DATA_ENV = "GPUSHARE_SIM_DATA"

#: SMs of the V100 the Orion and iGniter profiles were measured on.
PROFILE_SM_COUNT = 80

#: Chunk bound when merging an inference profile's kernels (see :func:`merge_kernels`).
DEFAULT_MERGE_ONLINE_US = 50.0
#: Chunk bound when merging a training profile's kernels.
DEFAULT_MERGE_OFFLINE_US = 100.0
DEFAULT_MERGE_US = DEFAULT_MERGE_ONLINE_US


class DataError(Exception):
    """A data file is missing or malformed; the message names the file and the fix."""


def package_dir(name: str) -> Path:
    """A folder of files shipped in the package (``gpushare/<name>``)."""
    root = resources.files("gpushare").joinpath(name)
    # A regular install or a checkout gives a real directory; a zipped install is not supported
    # (the loaders open files by path), and says so instead of failing on a missing file.
    if not isinstance(root, Path):
        raise DataError(f"gpushare's {name} folder is not a directory ({root}); install unzipped")
    return root


def package_root() -> Path:
    """The data folder shipped in the package (``gpushare/data``)."""
    return package_dir("data")


def search_roots() -> list[Path]:
    """Where relative data names are looked up, in order: ``$GPUSHARE_SIM_DATA``, the package.

    Raises:
        DataError: ``$GPUSHARE_SIM_DATA`` is set but is not a directory.
    """
    roots: list[Path] = []
    env = os.environ.get(DATA_ENV)
    if env:
        user = Path(env)
        if not user.is_dir():
            raise DataError(
                f"{DATA_ENV}={env} is not a directory; point it at a folder of your own profiles "
                f"and traces, or unset it to use the shipped data"
            )
        roots.append(user)
    roots.append(package_root())
    return roots


def resolve(name: str | Path) -> Path:
    """The file a data name stands for: ``NAME`` or ``NAME.gz`` under the first root that has it.

    Raises:
        DataError: no root has the file; the message lists every path tried.
    """
    path = Path(name)
    roots = [Path("/")] if path.is_absolute() else search_roots()
    tried: list[Path] = []
    for root in roots:
        for candidate in (root / path, root / f"{path}.gz"):
            if candidate.is_file():
                return candidate
            tried.append(candidate)
    raise DataError(f"no such data file {str(name)!r} (tried {', '.join(map(str, tried))})")


@contextmanager
def open_text(path: Path) -> Iterator[TextIO]:
    """Open a data file as text, decompressing a ``.gz`` file."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8", newline="") as fh:
            yield fh
    else:
        with path.open(encoding="utf-8", newline="") as fh:
            yield fh


@dataclass(frozen=True, slots=True)
class KernelProfile:
    """A kernel sequence (one inference request or one training iteration) as parallel tuples.

    ``dur_s`` is each kernel's run time when it holds ``width`` SMs alone on the GPU; ``width`` is the
    SMs it can use (its block count, capped at the GPU's SMs); ``mem`` is its memory-boundness in
    [0, 1] (Orion's roofline class: 1 memory-bound, 0 compute-bound, 0.5 unknown).
    """

    name: str
    dur_s: tuple[float, ...]
    width: tuple[int, ...]
    mem: tuple[float, ...]
    source_kernels: int
    #: Per chunk, its source kernels as ``(duration_us, sm_usage)``: ``sm_usage`` is Orion's
    #: ``SM_usage`` uncapped, ``ceil(blocks / blocks_per_sm)`` at the kernel's theoretical
    #: occupancy, in SMs of the profiled V100; what the wave rule (docs/simulator.md G6) reads.
    parts: tuple[tuple[tuple[float, int], ...], ...] = ()

    @property
    def total_s(self) -> float:
        """Run time of the whole sequence alone on a full GPU."""
        return math.fsum(self.dur_s)

    def __len__(self) -> int:
        return len(self.dur_s)


def merge_kernels(
    rows: list[tuple[float, int, float]] | list[tuple[float, int, float, int]],
    merge_us: float,
    name: str,
    sm_count: int,
) -> KernelProfile:
    """Merge runs of consecutive kernels into chunks of at most ``merge_us`` microseconds.

    Why: training iterations hold ~1,000-5,000 kernels, most a few microseconds long; simulating
    each one would make a scenario slower than real time in Python. A kernel longer than the bound
    is never merged, so the long kernels that dominate how long another client waits for SMs (the
    length-biased residual) are kept exactly; merging training profiles at 100 us changes that
    residual by under 3 % for every shipped profile, and the Orion co-location point moves by
    under 5 % against no merging at all (``docs/simulator.md``). A chunk's width and memory-boundness
    are duration-weighted means of its kernels.
    """
    dur: list[float] = []
    width: list[int] = []
    mem: list[float] = []
    parts: list[tuple[tuple[float, int], ...]] = []
    part: list[tuple[float, int]] = []
    acc_d = acc_w = acc_m = 0.0
    for row in rows:
        d_us, w, m = row[0], row[1], row[2]
        # Rows without a raw SM_usage (callers that build profiles by hand): the width in V100 SMs.
        u = row[3] if len(row) > 3 else round(w * PROFILE_SM_COUNT / sm_count)
        if acc_d > 0.0 and acc_d + d_us > merge_us:
            dur.append(acc_d * 1e-6)
            width.append(max(1, min(sm_count, round(acc_w / acc_d))))
            mem.append(acc_m / acc_d)
            parts.append(tuple(part))
            part = []
            acc_d = acc_w = acc_m = 0.0
        acc_d += d_us
        acc_w += min(w, sm_count) * d_us
        acc_m += m * d_us
        part.append((d_us, u))
    if acc_d > 0.0:
        dur.append(acc_d * 1e-6)
        width.append(max(1, min(sm_count, round(acc_w / acc_d))))
        mem.append(acc_m / acc_d)
        parts.append(tuple(part))
    return KernelProfile(name, tuple(dur), tuple(width), tuple(mem), len(rows), tuple(parts))


def wave_s(part: tuple[tuple[float, int], ...], wave_scale: float = 1.0) -> float:
    """How long one wave of a chunk's blocks lives, in seconds: the wave rule (G6).

    A kernel of ``SM_usage`` u runs as ``max(1, ceil(wave_scale * u / 80))`` waves of equal length
    (u is in full-occupancy SMs of the 80-SM V100 it was profiled on, so the count does not
    depend on the simulated GPU's size). A chunk's wave length is the duration-weighted mean of
    its kernels' (what a waiter arriving at a random time sees), so a long single-wave kernel
    merged with short ones keeps most of its weight.
    """
    total = 0.0
    weighted = 0.0
    for d_us, u in part:
        waves = max(1, math.ceil(wave_scale * u / PROFILE_SM_COUNT - 1e-9))
        total += d_us
        weighted += d_us * d_us / waves
    return weighted / total * 1e-6 if total > 0.0 else 0.0


def wave_tail(part: tuple[tuple[float, int], ...], wave_scale: float = 1.0) -> float:
    """The fraction of its slots a chunk's last wave fills.

    Below 1 only for a single kernel of several waves whose block count is not a whole number
    of waves: its tail leaves slots to other clients' blocks (co-residency, G6).
    """
    if len(part) != 1:
        return 1.0
    w = wave_scale * part[0][1] / PROFILE_SM_COUNT
    waves = max(1, math.ceil(w - 1e-9))
    if waves < 2:
        return 1.0
    return w - (waves - 1)


@functools.lru_cache(maxsize=64)
def load_profile(
    relative: str, merge_us: float = DEFAULT_MERGE_US, sm_count: int = PROFILE_SM_COUNT
) -> KernelProfile:
    """Load an Orion per-kernel profile: its ``Profile``, ``SM_usage`` and ``Duration`` columns.

    The upstream files' other columns (``Name``, ``Memory_footprint``) are not read. Widths are scaled from the V100's 80 SMs to ``sm_count``.

    Raises:
        DataError: the file is missing or a row is malformed.
    """
    path = resolve(relative)
    try:
        with open_text(path) as fh:
            reader = csv.DictReader(fh)
            rows: list[tuple[float, int, float, int]] = []
            for lineno, row in enumerate(reader, start=2):
                try:
                    d_us = int(row["Duration"]) / 1000.0
                    blocks = int(row["SM_usage"])
                    prof = int(row["Profile"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise DataError(
                        f"{path}:{lineno}: expected integer Profile, SM_usage and Duration columns "
                        f"({exc})"
                    ) from exc
                mem = 1.0 if prof == 0 else 0.0 if prof == 1 else 0.5
                width = max(1, round(min(blocks, PROFILE_SM_COUNT) * sm_count / PROFILE_SM_COUNT))
                if d_us > 0:
                    rows.append((d_us, width, mem, max(1, blocks)))
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise DataError(f"cannot read kernel profile {path}: {_why(exc)}") from exc
    if not rows:
        raise DataError(f"kernel profile {path} has no kernels")
    return merge_kernels(rows, merge_us, path.name.split(".")[0], sm_count)


@functools.lru_cache(maxsize=16)
def load_azure_arrivals(relative: str) -> tuple[float, ...]:
    """Arrival times in seconds from the start of an Azure LLM trace (``TIMESTAMP`` column).

    Raises:
        DataError: the file is missing or a timestamp is malformed.
    """
    path = resolve(relative)
    times: list[float] = []
    try:
        with open_text(path) as fh:
            for lineno, row in enumerate(csv.DictReader(fh), start=2):
                stamp = row.get("TIMESTAMP", "")
                try:
                    # Seven fractional digits: Python parses at most six.
                    head, _, frac = stamp.partition(".")
                    t = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
                    times.append(t + float("0." + (frac or "0")))
                except ValueError as exc:
                    raise DataError(f"{path}:{lineno}: bad TIMESTAMP {stamp!r}") from exc
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise DataError(f"cannot read arrival trace {path}: {_why(exc)}") from exc
    if not times:
        raise DataError(f"arrival trace {path} has no rows")
    times.sort()
    t0 = times[0]
    return tuple(t - t0 for t in times)


@functools.lru_cache(maxsize=16)
def load_genai_qps(relative: str) -> tuple[float, ...]:
    """Per-minute total QPS of the Alibaba GenAI service, from the first minute to the last.

    Reads the shipped ``qps_per_minute.csv`` (``minute,qps``) or the upstream ``qps.tar.gz``
    (``qps.csv`` inside: ``timestamp_anon,value`` per container, summed here per minute).

    Raises:
        DataError: the file is missing or malformed.
    """
    path = resolve(relative)
    per_minute: dict[int, float] = {}
    try:
        if path.name.endswith((".tar.gz", ".tgz")):
            _read_genai_archive(path, per_minute)
        else:
            with open_text(path) as fh:
                for lineno, row in enumerate(csv.DictReader(fh), start=2):
                    try:
                        per_minute[int(row["minute"])] = float(row["qps"])
                    except (KeyError, TypeError, ValueError) as exc:
                        raise DataError(f"{path}:{lineno}: bad minute/qps ({exc})") from exc
    except (OSError, UnicodeDecodeError, EOFError, tarfile.TarError) as exc:
        raise DataError(f"cannot read QPS series {path}: {_why(exc)}") from exc
    if not per_minute:
        raise DataError(f"QPS series {path} has no rows")
    first, last = min(per_minute), max(per_minute)
    return tuple(per_minute.get(m, 0.0) for m in range(first, last + 1))


def _read_genai_archive(path: Path, per_minute: dict[int, float]) -> None:
    with tarfile.open(path) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith(".csv")), None)
        extracted = tar.extractfile(member) if member else None
        if extracted is None:
            raise DataError(f"{path}: no CSV inside the archive")
        text = io.TextIOWrapper(extracted, encoding="utf-8")
        for lineno, row in enumerate(csv.DictReader(text), start=2):
            try:
                minute = int(float(row["timestamp_anon"]) // 60)
                per_minute[minute] = per_minute.get(minute, 0.0) + float(row["value"])
            except (KeyError, TypeError, ValueError) as exc:
                raise DataError(f"{path}:{lineno}: bad timestamp_anon/value ({exc})") from exc


def _why(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__


@dataclass(frozen=True, slots=True)
class PodShare:
    """One single-GPU pod of the Alibaba GPU trace that asked for a fraction of a GPU."""

    name: str
    qos: str
    gpu_milli: int


@functools.lru_cache(maxsize=4)
def load_alibaba_pods(relative: str) -> tuple[PodShare, ...]:
    """Single-GPU LS and BE pods with a fractional ``gpu_milli`` from the Alibaba GPU trace.

    Raises:
        DataError: the file is missing or malformed.
    """
    path = resolve(relative)
    pods: list[PodShare] = []
    try:
        with open_text(path) as fh:
            for lineno, row in enumerate(csv.DictReader(fh), start=2):
                try:
                    num_gpu = int(row["num_gpu"])
                    milli = int(row["gpu_milli"])
                except (KeyError, ValueError) as exc:
                    raise DataError(f"{path}:{lineno}: bad num_gpu/gpu_milli ({exc})") from exc
                if num_gpu == 1 and 0 < milli < 1000 and row.get("qos") in ("LS", "BE"):
                    pods.append(PodShare(row["name"], row["qos"], milli))
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise DataError(f"cannot read pod list {path}: {_why(exc)}") from exc
    if not pods:
        raise DataError(f"pod list {path} has no fractional single-GPU LS/BE pods")
    return tuple(pods)
