"""CPU cost per launch of the in-flight interposer (gpushare/native/inflight.c), on a fake driver.

Builds the interposer (scripts/build-native.sh), the fake ``libcuda.so.1`` and the launcher program
of tests/native into a temporary directory, then times a loop of N launches of zero-length
"kernels" on one stream (the program's own clock around the loop, not process start-up):

- ``bare``: no interposer;
- ``passthrough``: the interposer with no bound (``GPUSHARE_MAX_INFLIGHT`` unset): the cost of
  the wrapper alone;
- ``bounded_never_full``: k = 1024 with N < 1024 launches: the bookkeeping of a launch that does
  not wait (capture query, event record into the pool, the ring under its mutex);
- ``bounded_k2``: k = 2: every launch waits for an older one; this includes the fake GPU's thread
  hand-offs, so it is a bound on this machine's wake-up latency, not the interposer's own cost.

Median over repeats of ns per launch; prints a table and writes bench/results/inflight_overhead.json.
Runs in a few seconds; without a C compiler it writes the reason instead.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests" / "native"
RESULTS = ROOT / "bench" / "results" / "inflight_overhead.json"
N = 1000
REPEATS = 15
FLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"]


def build(cc: str, d: Path) -> tuple[Path, Path]:
    lib = d / "libgpushare_inflight.so"
    subprocess.run(["sh", str(ROOT / "scripts" / "build-native.sh"), str(lib)], check=True)
    fake = [cc, *FLAGS, "-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", "-Wl,-Bsymbolic"]
    subprocess.run([*fake, "-o", str(d / "libcuda.so.1"), str(TESTS / "fake_cuda.c")], check=True)
    prog = d / "launcher_prog"
    link = [f"-L{d}", "-l:libcuda.so.1", f"-Wl,-rpath,{d}", "-ldl", "-lpthread"]
    subprocess.run([cc, *FLAGS, "-o", str(prog), str(TESTS / "launcher_prog.c"), *link], check=True)
    return lib, prog


def ns_per_launch(prog: Path, lib: Path | None, bound: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    env.pop("LD_PRELOAD", None)
    if lib is not None:
        env["LD_PRELOAD"] = str(lib)
    if bound is not None:
        env["GPUSHARE_MAX_INFLIGHT"] = bound
    runs = []
    for _ in range(REPEATS):
        p = subprocess.run(
            [str(prog), "direct", "kernel", str(N), "0"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        runs.append(json.loads(p.stdout)["launch_loop_ns"] / N)
    return statistics.median(runs)


def main() -> int:
    cc = shutil.which(os.environ.get("CC", "cc"))
    results: dict[str, Any] = {"launches": N, "repeats": REPEATS, "machine": os.uname().machine}
    if cc is None:
        results["skipped"] = "no C compiler (cc) on PATH"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            lib, prog = build(cc, Path(tmp))
            modes = {
                "bare": (None, None),
                "passthrough": (lib, None),
                "bounded_never_full": (lib, "1024"),
                "bounded_k2": (lib, "2"),
            }
            for name, (with_lib, bound) in modes.items():
                results[f"{name}_ns_per_launch"] = round(ns_per_launch(prog, with_lib, bound), 1)
            bare = float(results["bare_ns_per_launch"])
            for name in ("passthrough", "bounded_never_full"):
                added = float(results[f"{name}_ns_per_launch"]) - bare
                results[f"{name}_added_ns"] = round(added, 1)
    for key, value in results.items():
        print(f"{key:32s} {value}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
