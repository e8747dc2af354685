#!/usr/bin/env python3
"""GPU-host check of the shallow-queue interposer (gpushare.native; docs/gpu-validation.md).

    scripts/build-native.sh && python3 scripts/gpu-check-inflight.py [--n 5000] [--kernel-us 50]
        [--host-us 20] [--out inflight-check.json]

Runs one CUDA client per mode, each a child of this script talking to the driver through ctypes
(no CUDA toolkit, no cuda-python: a hand-written PTX kernel that spins on %globaltimer):

- ``unbounded``: nothing set (the deep queue today);
- ``k1`` / ``k2`` / ``k4``: ``LD_PRELOAD`` the interposer with ``GPUSHARE_MAX_INFLIGHT`` = 1/2/4,
  launches found with ``dlsym(handle, "cuLaunchKernel")`` (as ctypes and most bindings do);
- ``k2-gpa``: k = 2, ``cuLaunchKernel`` fetched through ``cuGetProcAddress_v2`` (as cudart and
  cuda-python do, CUDA >= 11.3);
- ``blocking``: ``CUDA_LAUNCH_BLOCKING=1``, what shallow meant before.

Each launch is preceded by ``--host-us`` of CPU work (the framework's per-kernel time). The queue
depth is measured on the GPU, not taken from the interposer: after each launch returns the host
writes the number of launches issued so far into pinned, mapped memory, and kernel i reads it when
it finishes, so ``issued_at_end[i] - i`` is how many kernels were queued or running when kernel i
ended. Prints one JSON line per mode and exits 0 only if: every bounded mode's measured depth and
its stats file's ``max_inflight`` are <= k, ``k2``'s run time is within 10 % of ``unbounded``'s
(the point: the bound costs little when k >= 2), and ``unbounded``'s depth exceeds 4 (else the
check could not tell the modes apart).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LIBRARY = REPO / "gpushare" / "native" / "libgpushare_inflight.so"

# spin(ns, issued, out, index): busy-wait `ns` on %globaltimer, then out[index] = *issued, read at
# system scope (host-mapped memory the host keeps writing).
PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 p_ns, .param .u64 p_issued, .param .u64 p_out, .param .u32 p_idx)
{
    .reg .pred p;
    .reg .u64 ns, t0, now, end, issued, out, off;
    .reg .u32 idx, v;
    ld.param.u64 ns, [p_ns];
    ld.param.u64 issued, [p_issued];
    ld.param.u64 out, [p_out];
    ld.param.u32 idx, [p_idx];
    mov.u64 t0, %globaltimer;
    add.u64 end, t0, ns;
WAIT:
    mov.u64 now, %globaltimer;
    setp.lt.u64 p, now, end;
    @p bra WAIT;
    ld.relaxed.sys.global.u32 v, [issued];
    mul.wide.u32 off, idx, 4;
    add.u64 out, out, off;
    st.global.u32 [out], v;
    ret;
}
\x00"""

MODES: dict[str, dict[str, str]] = {
    "unbounded": {},
    "blocking": {"CUDA_LAUNCH_BLOCKING": "1"},
    "k1": {"GPUSHARE_MAX_INFLIGHT": "1"},
    "k2": {"GPUSHARE_MAX_INFLIGHT": "2"},
    "k2-gpa": {"GPUSHARE_MAX_INFLIGHT": "2"},
    "k4": {"GPUSHARE_MAX_INFLIGHT": "4"},
}


def child(mode: str, n: int, kernel_us: int, host_us: int) -> dict[str, Any]:
    """One CUDA client: n launches, each after host_us of CPU work; returns what it measured."""
    cu = ctypes.CDLL("libcuda.so.1")

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    vp = ctypes.c_void_p
    check(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = vp()
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    mod, fn = vp(), vp()
    check(cu.cuModuleLoadData(ctypes.byref(mod), PTX), "cuModuleLoadData")
    check(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin"), "cuModuleGetFunction")
    stream = vp()
    check(cu.cuStreamCreate(ctypes.byref(stream), 0), "cuStreamCreate")

    # cuMemHostAlloc flags (cuda.h): CU_MEMHOSTALLOC_PORTABLE 0x1 | CU_MEMHOSTALLOC_DEVICEMAP 0x2.
    cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(vp), ctypes.c_size_t, ctypes.c_uint]
    issued_p, out_p = vp(), vp()
    check(cu.cuMemHostAlloc(ctypes.byref(issued_p), 4, 3), "cuMemHostAlloc")
    check(cu.cuMemHostAlloc(ctypes.byref(out_p), 4 * n, 3), "cuMemHostAlloc")
    issued = ctypes.cast(issued_p, ctypes.POINTER(ctypes.c_uint32))
    out = ctypes.cast(out_p, ctypes.POINTER(ctypes.c_uint32))
    issued[0] = 0

    launch_type = ctypes.CFUNCTYPE(
        ctypes.c_int, vp, *[ctypes.c_uint] * 7, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)
    )
    if mode == "k2-gpa":
        # What cudart does: the entry point through cuGetProcAddress_v2 (CUDA 12 ABI).
        pfn = vp()
        gpa = cu.cuGetProcAddress_v2
        gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(vp), ctypes.c_int, ctypes.c_uint64, vp]
        check(gpa(b"cuLaunchKernel", ctypes.byref(pfn), 12000, 0, None), "cuGetProcAddress_v2")
        launch = launch_type(pfn.value)
    else:
        launch = launch_type(ctypes.cast(cu.cuLaunchKernel, vp).value)

    ns = ctypes.c_uint64(kernel_us * 1000)
    a_issued = ctypes.c_uint64(issued_p.value or 0)
    a_out = ctypes.c_uint64(out_p.value or 0)
    idx = ctypes.c_uint32(0)
    params = (vp * 4)(*[ctypes.cast(ctypes.byref(x), vp) for x in (ns, a_issued, a_out, idx)])

    def spin_host() -> None:
        end = time.perf_counter_ns() + host_us * 1000
        while time.perf_counter_ns() < end:
            pass

    # Warm-up (module load, first-launch costs), not measured.
    for _ in range(20):
        check(launch(fn, 1, 1, 1, 1, 1, 1, 0, stream, params, None), "cuLaunchKernel")
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    issued[0] = 0
    t0 = time.perf_counter()
    for i in range(n):
        spin_host()
        idx.value = i
        check(launch(fn, 1, 1, 1, 1, 1, 1, 0, stream, params, None), "cuLaunchKernel")
        issued[0] = i + 1
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    wall_s = time.perf_counter() - t0
    depth = max(out[i] - i for i in range(n))
    return {"mode": mode, "n": n, "wall_s": round(wall_s, 4), "max_depth_measured": depth}


def main() -> int:
    """Run every mode as a child, print each result and the verdicts; 0 only if all pass."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--kernel-us", type=int, default=50)
    ap.add_argument("--host-us", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.n, a.kernel_us, a.host_us)))
        return 0
    if not LIBRARY.is_file():
        print(f"{LIBRARY} is not built: run scripts/build-native.sh first", file=sys.stderr)
        return 2
    results: dict[str, dict[str, Any]] = {}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for mode, extra in MODES.items():
            env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
            env.pop("CUDA_LAUNCH_BLOCKING", None)
            env.update(extra)
            stats = Path(tmp) / f"{mode}.json"
            if "GPUSHARE_MAX_INFLIGHT" in extra:
                env["LD_PRELOAD"] = ":".join(p for p in (str(LIBRARY), env.get("LD_PRELOAD")) if p)
                env["GPUSHARE_INFLIGHT_STATS"] = str(stats)
            cmd = [sys.executable, __file__, "--child", mode, "--n", str(a.n)]
            cmd += ["--kernel-us", str(a.kernel_us), "--host-us", str(a.host_us)]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            if p.returncode != 0:
                print(f"FAIL {mode}: {p.stderr.strip()}")
                return 1
            r = json.loads(p.stdout)
            if stats.exists():
                r["stats"] = json.loads(stats.read_text())
            results[mode] = r
            print(json.dumps(r), flush=True)
    base = float(results["unbounded"]["wall_s"])
    for mode, r in results.items():
        k = int(MODES[mode].get("GPUSHARE_MAX_INFLIGHT", "0"))
        r["slowdown_vs_unbounded"] = round(float(r["wall_s"]) / base, 3)
        if k:
            st = r.get("stats") or {}
            good = (
                r["max_depth_measured"] <= k
                and st.get("max_inflight", k + 1) <= k
                and st.get("passthrough_reason") is None
            )
            print(f"{'PASS' if good else 'FAIL'} {mode}: depth {r['max_depth_measured']} <= {k}")
            ok &= good
    deep = results["unbounded"]["max_depth_measured"]
    print(f"{'PASS' if deep > 4 else 'FAIL'} unbounded: depth {deep} > 4 (the check can tell)")
    ok &= deep > 4
    near = float(results["k2"]["slowdown_vs_unbounded"]) <= 1.10
    print(f"{'PASS' if near else 'FAIL'} k2 within 10 % of unbounded: {results['k2']}")
    ok &= near
    print(f"info blocking: {results['blocking']['slowdown_vs_unbounded']}x unbounded's time")
    if a.out:
        a.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
