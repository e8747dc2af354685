"""NVML checks for people: the doctor's NVML line and a command that prints what NVML reads.

* :func:`host_status`: whether NVML initialises here, the driver version and the GPU count
  (``gpushare doctor``).
* ``python -m gpushare.node.nvml_diag``: samples and XID events as JSON lines, for the checks on a
  GPU host in docs/gpu-validation.md.

Both go through :class:`gpushare.node.nvml.NvmlBackend`, the only module that talks to NVML.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

from gpushare.logs import configure_logging
from gpushare.node.nvml import NvmlBackend
from gpushare.node.nvml_errors import NvmlInitError


def host_status() -> tuple[bool, str, str]:
    """Whether NVML initialises on this host: ``(ok, what was seen, hint)`` for ``gpushare doctor``."""
    backend = NvmlBackend(events=False, init_timeout_s=10.0, call_timeout_s=5.0)
    try:
        uuids = backend.gpu_uuids()
        driver = backend.driver_version()
    except NvmlInitError as exc:
        message, _, hint = str(exc).partition("HINT: ")
        return False, message.strip(), hint.strip()
    except Exception as exc:  # noqa: BLE001 - the doctor reports any failure as a line, never a crash
        return False, f"{type(exc).__name__}: {exc}", ""
    finally:
        backend.close()
    return True, f"driver {driver}, {len(uuids)} GPU(s)", ""


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpushare.node.nvml_diag``: print samples and XID events as JSON lines (GPU checks)."""
    parser = argparse.ArgumentParser(prog="python -m gpushare.node.nvml_diag")
    parser.add_argument("--count", type=int, default=1, help="ticks to sample")
    parser.add_argument("--interval-s", type=float, default=0.5, help="time between ticks")
    parser.add_argument("--events-s", type=float, default=0.0, help="then wait this long for XIDs")
    args = parser.parse_args(argv)
    # stdout carries the JSON lines; logs go to stderr.
    configure_logging("info")
    backend = NvmlBackend(events=args.events_s > 0)
    try:
        backend.open()
    except NvmlInitError as exc:
        print(exc, file=sys.stderr)
        return 1
    try:
        for i in range(args.count):
            if i:
                time.sleep(args.interval_s)
            for s in backend.sample():
                print(json.dumps({"type": "sample", **dataclasses.asdict(s)}), flush=True)
        deadline = time.monotonic() + args.events_s
        while time.monotonic() < deadline:
            for e in backend.drain_events():
                print(json.dumps({"type": "xid", **dataclasses.asdict(e)}), flush=True)
            time.sleep(0.1)
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
