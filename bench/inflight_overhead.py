"""CPU cost per launch of the in-flight interposer (gpushare/native/inflight.c), on a fake driver.

Builds the interposer (gpushare.native.build), the fake ``libcuda.so.1`` and the launcher program
of tests/native into a temporary directory, then times loops of zero-length "kernels" (the
program's own clock around the launch loops, not process start-up), in each threads x streams
configuration (1, 4 and 16 of each; every thread launches round-robin over its own streams):

- ``bare``: no interposer;
- ``passthrough``: the interposer with no bound (``GPUSHARE_MAX_INFLIGHT`` unset): the cost of
  the wrapper alone;
- ``bounded_never_full``: k = 1024 with fewer than 1024 launches in all: the bookkeeping of a
  launch that does not wait (capture query, context and its id, a slot and a pooled event under
  the mutex, the event record);
- ``bounded_k2``: k = 2: launches wait for older ones; this includes the fake GPU's thread
  hand-offs, so it is a bound on this machine's wake-up latency, not the interposer's own cost.

``--baseline-rev REV`` (default b0c0ecb, the library before issue 31) builds that revision's
inflight.c too (``git show``), so each number comes before and after. Also measured: how long
``nanosleep(50 us)`` sleeps here (the interposer's nap between polls; timer slack stretches it).
ns per launch is the loop's wall time over all launches (with several threads, a throughput);
the minimum over repeats (a loop of under a millisecond: on a busy machine the median measures
the other processes; the minimum is the one run nothing preempted). Prints a table and writes bench/results/inflight_overhead.json. About a
minute; without a C compiler it writes the reason instead.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpushare.native import build as native_build  # noqa: E402

TESTS = ROOT / "tests" / "native"
RESULTS = ROOT / "bench" / "results" / "inflight_overhead.json"
TOTAL = 960  # launches per run, over all threads: below 1024, so k = 1024 never fills
REPEATS = 21
CONFIGS = ((1, 1), (1, 4), (1, 16), (4, 1), (16, 1))  # (threads, streams per thread)
FLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"]
MODES = {"bare": (False, None), "passthrough": (True, None)}
MODES |= {"bounded_never_full": (True, "1024"), "bounded_k2": (True, "2")}


def build_fake(cc: str, d: Path) -> Path:
    fake = [cc, *FLAGS, "-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", "-Wl,-Bsymbolic"]
    subprocess.run([*fake, "-o", str(d / "libcuda.so.1"), str(TESTS / "fake_cuda.c")], check=True)
    prog = d / "launcher_prog"
    link = [f"-L{d}", "-l:libcuda.so.1", f"-Wl,-rpath,{d}", "-ldl", "-lpthread"]
    subprocess.run([cc, *FLAGS, "-o", str(prog), str(TESTS / "launcher_prog.c"), *link], check=True)
    return prog


def build_lib(d: Path, name: str, source: Path) -> Path:
    lib = d / name
    ok, line = native_build.build(lib, source=source)
    if not ok:
        raise SystemExit(line)
    return lib


def baseline_source(rev: str, d: Path) -> Path | None:
    """inflight.c at ``rev``, or None outside a git checkout."""
    try:
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:gpushare/native/inflight.c"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    path = d / "inflight_baseline.c"
    path.write_text(text)
    return path


def ns_per_launch(
    prog: Path, lib: Path | None, bound: str | None, threads: int, streams: int
) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    env.pop("LD_PRELOAD", None)
    if lib is not None:
        env["LD_PRELOAD"] = str(lib)
    if bound is not None:
        env["GPUSHARE_MAX_INFLIGHT"] = bound
    per_thread = TOTAL // threads
    argv = [str(prog), "direct", "kernel", str(per_thread), "0", str(streams), str(threads)]
    runs = []
    # k = 2 waits on the fake GPU's hand-offs (tens of ms a run, little spread): fewer repeats.
    for _ in range(REPEATS if bound != "2" else 5):
        p = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=60)
        runs.append(json.loads(p.stdout)["launch_loop_ns"] / (per_thread * threads))
    return min(runs)


def nap_us(n: int = 2000) -> float:
    """Median length of nanosleep(50 us) in this process, in us (the interposer's poll nap)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    req = Timespec(0, 50_000)
    took = []
    for _ in range(n):
        t = time.perf_counter_ns()
        libc.nanosleep(ctypes.byref(req), None)
        took.append((time.perf_counter_ns() - t) / 1000)
    return statistics.median(took)


def measure(prog: Path, libs: dict[str, Path]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for threads, streams in CONFIGS:
        row: dict[str, float] = {}
        row["bare"] = round(ns_per_launch(prog, None, None, threads, streams), 1)
        for version, lib in libs.items():
            for mode, (with_lib, bound) in MODES.items():
                if with_lib:
                    ns = ns_per_launch(prog, lib, bound, threads, streams)
                    row[f"{version}_{mode}"] = round(ns, 1)
        out[f"threads{threads}_streams{streams}"] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-rev", default="b0c0ecb", help="git revision to compare with")
    args = ap.parse_args()
    cc = shutil.which(os.environ.get("CC", "cc"))
    results: dict[str, Any] = {
        "launches_per_run": TOTAL,
        "repeats": REPEATS,
        "machine": os.uname().machine,
        "cpus": os.cpu_count(),
        "nanosleep_50us_median_us": round(nap_us(), 1),
    }
    if cc is None:
        results["skipped"] = "no C compiler (cc) on PATH"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            prog = build_fake(cc, d)
            libs = {"after": build_lib(d, "after.so", native_build.SOURCE)}
            base = baseline_source(args.baseline_rev, d)
            if base is not None:
                libs["before"] = build_lib(d, "before.so", base)
                results["baseline_rev"] = args.baseline_rev
            results["ns_per_launch"] = measure(prog, libs)
    print(json.dumps(results, indent=1))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
