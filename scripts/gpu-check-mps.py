#!/usr/bin/env python3
"""GPU-host checks of the MPS supervisor (docs/gpu-validation.md): run as root on a GPU host.

    sudo .venv/bin/python scripts/gpu-check-mps.py connect   # a CUDA client goes through the daemon
    sudo .venv/bin/python scripts/gpu-check-mps.py limits    # SM share and pinned-memory cap as a client sees them
    sudo .venv/bin/python scripts/gpu-check-mps.py fault     # a faulting client, then MpsSupervisor.recover()

Each check starts an ``MpsSupervisor`` on the first GPU (or ``--gpu UUID``) in a temporary
directory, runs CUDA clients (this script re-run with ``--client``) through its pipe directory with
cuda-python, prints what it saw, and exits 0 only if every expectation held. The supervisor is
stopped at the end (``quit -t``), leaving the GPU as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MIB = 1 << 20
GIB = 1 << 30
BAD_KERNEL = b'extern "C" __global__ void bad(int *p) { *(volatile int *)((char *)0 + 16) = 1; }\n'


# --- client side (runs in a child process with the MPS environment) ------------------------


def _cuda() -> tuple[object, object]:
    try:
        from cuda.bindings import driver as cu
        from cuda.bindings import nvrtc
    except ImportError:  # cuda-python < 12.6
        from cuda import cuda as cu
        from cuda import nvrtc
    return cu, nvrtc


def client(mode: str) -> int:
    """One check's CUDA client, run inside the MPS environment; prints a JSON report line."""
    cu, nvrtc = _cuda()

    def check(ret: tuple) -> object:
        status, *out = ret
        if int(status) != 0:
            raise RuntimeError(f"CUDA error {int(status)} ({status})")
        return out[0] if len(out) == 1 else out

    report: dict[str, object] = {"pid": os.getpid(), "mode": mode}
    check(cu.cuInit(0))
    dev = check(cu.cuDeviceGet(0))
    attr = cu.CUdevice_attribute
    report["mps_enabled"] = check(cu.cuDeviceGetAttribute(attr(133), dev))
    report["sm_count"] = check(
        cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
    )
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev))
    check(cu.cuCtxSetCurrent(ctx))
    if mode == "limits":
        try:
            aff = check(
                cu.cuCtxGetExecAffinity(cu.CUexecAffinityType.CU_EXEC_AFFINITY_TYPE_SM_COUNT)
            )
            report["exec_affinity_sm_count"] = int(aff.param.smCount.val)
        except Exception as exc:  # noqa: BLE001 - report, do not fail: the attribute is informative
            report["exec_affinity_sm_count"] = f"unavailable: {exc}"
        small = check(cu.cuMemAlloc(512 * MIB))
        report["alloc_512M"] = "ok"
        status = cu.cuMemAlloc(2 * GIB)[0]
        report["alloc_2G_status"] = int(status)
        check(cu.cuMemFree(small))
    if mode == "fault":
        major = check(
            cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        )
        minor = check(
            cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        )
        prog = check(nvrtc.nvrtcCreateProgram(BAD_KERNEL, b"bad.cu", 0, [], []))
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
        check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts))
        image = b" " * check(nvrtc.nvrtcGetCUBINSize(prog))
        check(nvrtc.nvrtcGetCUBIN(prog, image))
        mod = check(cu.cuModuleLoadData(image))
        fn = check(cu.cuModuleGetFunction(mod, b"bad"))
        check(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0))
        report["sync_status"] = int(cu.cuCtxSynchronize()[0])  # expect 700 ILLEGAL_ADDRESS
    if mode == "idle":
        # An innocent client on the same server: it should be hit by the fault of the other.
        print(json.dumps(report), flush=True)
        time.sleep(30)
        report["sync_status"] = int(cu.cuCtxSynchronize()[0])
    else:
        time.sleep(2)  # long enough for the parent to see the client in ps / get_client_list
    print(json.dumps(report), flush=True)
    return 0


# --- supervisor side ------------------------------------------------------------------------


def _first_gpu() -> str:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()[0]


def _spawn(mode: str, pipe_dir: Path, extra_env: dict[str, str]) -> subprocess.Popen[str]:
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir), **extra_env}
    env.pop(
        "CUDA_VISIBLE_DEVICES", None
    )  # the daemon has it; a client must not (MPS docs: environment variables)
    return subprocess.Popen(
        [sys.executable, __file__, "--client", mode], env=env, stdout=subprocess.PIPE, text=True
    )


def _report(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, _ = proc.communicate(timeout=120)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return (
        json.loads(lines[-1])
        if lines
        else {"error": f"client exited {proc.returncode} without a report"}
    )


def main() -> int:
    """Run one check (or, with ``--client``, be its CUDA client); 0 when every expectation held."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # "idle" is a client role only (an innocent client during the fault check).
    parser.add_argument("check", choices=["connect", "limits", "fault", "idle"])
    parser.add_argument("--gpu", help="GPU UUID (default: the first GPU)")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client(args.check)
    if args.check == "idle":
        parser.error("idle is a client role; run connect, limits or fault")

    from gpushare.config import Config, MpsConfig, PathsConfig
    from gpushare.model import MpsEventKind
    from gpushare.node.mps import MpsSupervisor

    gpu = args.gpu or _first_gpu()
    root = Path(tempfile.mkdtemp(prefix="gsv", dir="/tmp"))
    config = Config(
        paths=PathsConfig(runtime_dir=root, state_dir=root / "state"),
        mps=MpsConfig(
            compute_mode="leave", health_period_s=1.0, quit_timeout_s=5.0, ready_timeout_s=30.0
        ),
    )
    sup = MpsSupervisor(gpu, config)
    events: list[object] = []
    sup.subscribe(events.append)
    failures: list[str] = []

    def expect(ok: bool, what: str) -> None:
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    sup.start()
    try:
        if args.check == "connect":
            proc = _spawn("connect", sup.pipe_dir, {})
            time.sleep(1.5)
            rows = sup.control.ps()
            print("ps:", rows)
            rep = _report(proc)
            print("client:", rep)
            expect(
                rep.get("mps_enabled") == 1, "client reports CU_DEVICE_ATTRIBUTE_MPS_ENABLED == 1"
            )
            expect(any(r.client_pid == proc.pid for r in rows), "ps lists the client pid")
            kinds = {e.kind for e in events}  # type: ignore[attr-defined]
            expect(MpsEventKind.SERVER_STARTED in kinds, "SERVER_STARTED event seen")
            expect(MpsEventKind.CLIENT_CONNECTED in kinds, "CLIENT_CONNECTED event seen")
        elif args.check == "limits":
            env = {
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G",
            }
            rep = _report(_spawn("limits", sup.pipe_dir, env))
            print("client:", rep)
            expect(rep.get("mps_enabled") == 1, "client is under MPS")
            expect(rep.get("alloc_512M") == "ok", "512M allocation under a 1G cap succeeds")
            expect(
                rep.get("alloc_2G_status") == 2,
                "2G allocation under a 1G cap fails with CUDA_ERROR_OUT_OF_MEMORY (2)",
            )
            print("SM count", rep.get("sm_count"), "exec-affinity SM count", rep.get("exec_affinity_sm_count"),
                  "(expected about 25% of the SMs; record the value in docs/gpu-validation.md)")  # fmt: skip
        else:
            idle = _spawn("idle", sup.pipe_dir, {})
            assert idle.stdout is not None
            idle.stdout.readline()  # connected
            bad = _spawn("fault", sup.pipe_dir, {})
            rep = _report(bad)
            print("faulting client:", rep)
            expect(
                rep.get("sync_status") == 700,
                "faulting client gets CUDA_ERROR_ILLEGAL_ADDRESS (700)",
            )
            deadline = time.time() + 10
            while time.time() < deadline and not any(
                e.kind is MpsEventKind.FATAL_EXCEPTION for e in events
            ):  # type: ignore[attr-defined]
                time.sleep(0.1)
            print("state after fault:", sup.state())
            ok = sup.recover(offline_pids=[bad.pid], online_pids=[idle.pid])
            for e in events:
                if e.kind is MpsEventKind.RECOVERY_STEP:  # type: ignore[attr-defined]
                    print("  step:", e.text)  # type: ignore[attr-defined]
            idle.kill()
            idle.wait()
            expect(ok, "recover() reports no faulted server left")
            after = _report(_spawn("connect", sup.pipe_dir, {}))
            expect(after.get("mps_enabled") == 1, "a new client connects after recovery")
            print("state after recovery:", sup.state())
    finally:
        sup.stop()
        shutil.rmtree(root, ignore_errors=True)
    print("events:")
    for e in events:
        print(" ", e)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
