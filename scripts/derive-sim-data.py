#!/usr/bin/env python3
"""Rebuild the simulator's shipped data (``gpushare/data/``) from the published originals.

The package ships only what the simulator reads, derived from public datasets (each folder's
README names the source and licence). Whoever has the originals can check or rebuild every
derived file with::

    python scripts/derive-sim-data.py --from DIR [--to gpushare/data] [--check]

``DIR`` holds the originals in their upstream folder names (``orion-v100-kernels/``,
``igniter-v100/``, ``azure-llm-2023/``, ``alibaba-genai-2026/``, ``alibaba-gpu-v2023/``). With
``--check`` nothing is written: the script exits 1 and names every file that would change.

Derivations (the loaders in ``gpushare/sim/data.py`` read both forms and give the same result):

* Orion kernel profiles: the ``Profile``, ``SM_usage`` and ``Duration`` columns of every row
  (``Name`` and ``Memory_footprint`` are not read; the footprint is 0 in every row).
* Orion's measured plain-MPS point (``mps_example_*.json``) and the iGniter curves: copied.
* Azure LLM code trace: the ``TIMESTAMP`` column of every row, gzip-compressed.
* Azure LLM conversation trace: every row as ``arrival_s`` (seconds since the first request,
  from ``TIMESTAMP`` as UTC, to 1 us), ``context_tokens``, ``generated_tokens``,
  sorted by arrival, gzip-compressed.
* Alibaba GenAI service: ``qps.tar.gz`` summed over containers per minute
  (``qps_per_minute.csv``: minute from the first, total requests per second).
* Alibaba GPU trace: the rows the scenario generator keeps (single-GPU LS/BE pods asking for a
  fraction of a GPU), with the columns it reads, gzip-compressed.
"""

from __future__ import annotations

import argparse
import calendar
import csv
import gzip
import io
import shutil
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

PROFILES = "orion-v100-kernels"
COPIED = (
    f"{PROFILES}/mps_example_resnet50inf_resnet50train_V100.log.json",
    "igniter-v100/latency_vs_mps_thread_pct.csv",
    "igniter-v100/colocated_latency.csv",
)


def _csv_text(header: list[str], rows: list[list[str]]) -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue().encode()


def _gzip(payload: bytes) -> bytes:
    # mtime=0: the same input gives the same bytes, so --check and git see no spurious change.
    return gzip.compress(payload, compresslevel=9, mtime=0)


def profile(src: Path) -> bytes:
    """An Orion profile reduced to the columns the simulator reads."""
    with src.open(newline="") as fh:
        rows = [[r["Profile"], r["SM_usage"], r["Duration"]] for r in csv.DictReader(fh)]
    return _csv_text(["Profile", "SM_usage", "Duration"], rows)


def azure(src: Path) -> bytes:
    """The Azure trace's arrival timestamps."""
    with src.open(newline="") as fh:
        rows = [[r["TIMESTAMP"]] for r in csv.DictReader(fh)]
    return _gzip(_csv_text(["TIMESTAMP"], rows))


def _stamp_s(stamp: str) -> float:
    """A trace ``TIMESTAMP`` (``YYYY-MM-DD HH:MM:SS.fffffff``, UTC) in seconds since the epoch."""
    head, _, frac = stamp.partition(".")
    return calendar.timegm(time.strptime(head, "%Y-%m-%d %H:%M:%S")) + float("0." + (frac or "0"))


def azure_conv_tokens(src: Path) -> bytes:
    """The Azure conversation trace: arrival offsets and token counts, by arrival.

    The offsets are differences of doubles near 1.7e9 s, so they carry up to ~0.2 us of rounding,
    printed to 1 us: what the shipped file holds and the documented results were run on.
    """
    with src.open(newline="") as fh:
        rows = [
            (_stamp_s(r["TIMESTAMP"]), r["ContextTokens"], r["GeneratedTokens"])
            for r in csv.DictReader(fh)
        ]
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    out = [[f"{t - t0:.6f}", c, g] for t, c, g in rows]
    return _gzip(_csv_text(["arrival_s", "context_tokens", "generated_tokens"], out))


def genai_qps(src: Path) -> bytes:
    """Total QPS per minute of the GenAI service (the archive's rows summed per minute)."""
    per_minute: dict[int, float] = {}
    with tarfile.open(src) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".csv"))
        extracted = tar.extractfile(member)
        assert extracted is not None
        for r in csv.DictReader(io.TextIOWrapper(extracted, encoding="utf-8")):
            minute = int(float(r["timestamp_anon"]) // 60)
            per_minute[minute] = per_minute.get(minute, 0.0) + float(r["value"])
    first, last = min(per_minute), max(per_minute)
    rows = [[str(m - first), repr(per_minute.get(m, 0.0))] for m in range(first, last + 1)]
    return _csv_text(["minute", "qps"], rows)


def alibaba_pods(src: Path) -> bytes:
    """The fractional single-GPU LS/BE pods of the Alibaba GPU trace."""
    with src.open(newline="") as fh:
        rows = [
            [r["name"], r["num_gpu"], r["gpu_milli"], r["qos"]]
            for r in csv.DictReader(fh)
            if r["num_gpu"] == "1" and 0 < int(r["gpu_milli"]) < 1000 and r["qos"] in ("LS", "BE")
        ]
    return _gzip(_csv_text(["name", "num_gpu", "gpu_milli", "qos"], rows))


def derivations(src: Path) -> list[tuple[str, Callable[[], bytes]]]:
    """(target name under gpushare/data, how to build it) for every shipped file."""
    out: list[tuple[str, Callable[[], bytes]]] = []
    for p in sorted((src / PROFILES).glob("*_f*.csv")):
        out.append((f"{PROFILES}/{p.name}", lambda p=p: profile(p)))
    for name in COPIED:
        out.append((name, lambda name=name: (src / name).read_bytes()))
    out.append(
        (
            "azure-llm-2023/AzureLLMInferenceTrace_code.csv.gz",
            lambda: azure(src / "azure-llm-2023/AzureLLMInferenceTrace_code.csv"),
        )
    )
    out.append(
        (
            "azure-llm-2023/conv_tokens.csv.gz",
            lambda: azure_conv_tokens(src / "azure-llm-2023/AzureLLMInferenceTrace_conv.csv"),
        )
    )
    out.append(
        (
            "alibaba-genai-2026/qps_per_minute.csv",
            lambda: genai_qps(src / "alibaba-genai-2026/qps.tar.gz"),
        )
    )
    out.append(
        (
            "alibaba-gpu-v2023/openb_pod_list_default.csv.gz",
            lambda: alibaba_pods(src / "alibaba-gpu-v2023/openb_pod_list_default.csv"),
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """Build (or check) every derived file; exit 1 when --check finds a difference."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", type=Path, required=True, help="the originals")
    ap.add_argument(
        "--to", type=Path, default=Path(__file__).resolve().parents[1] / "gpushare" / "data"
    )
    ap.add_argument("--check", action="store_true", help="compare only; write nothing")
    args = ap.parse_args(argv)
    if not (args.src / PROFILES).is_dir():
        ap.error(f"{args.src} has no {PROFILES}/: point --from at the folder of the originals")
    differ = []
    for name, build in derivations(args.src):
        try:
            payload = build()
        except (OSError, KeyError, ValueError, tarfile.TarError, StopIteration) as exc:
            print(f"derive-sim-data: cannot derive {name}: {exc!r}", file=sys.stderr)
            return 2
        target = args.to / name
        same = target.is_file() and target.read_bytes() == payload
        if args.check:
            if not same:
                differ.append(name)
            continue
        if not same:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_bytes(payload)
            shutil.move(tmp, target)
        print(f"{'unchanged' if same else 'wrote':9} {name} ({len(payload):,} bytes)")
    if differ:
        print("differs from the originals: " + ", ".join(differ), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
