"""The daemon's own cost: CPU share of one core used by an idle ``gpushare daemon --simulate N``.

A node agent should be invisible. For N simulated GPUs and M idle clients (each ``sleep 600``
submitted with ``--offline --detach``, no simulated workload, so nothing on the GPU changes and
the daemon only keeps its books), this starts the real daemon as its own process with the real
cgroup v2 pauser (each client in its own cgroup), waits for start-up to settle, and reads the
daemon's CPU time (user + system, every thread) from ``/proc/PID/stat`` at the start and the end
of a fixed window. Its waited-for children (MPS front ends, when MPS is real) are counted
separately.

The loop ticks every ``control.period`` (100 ms) of wall time, so a daemon starved of CPU by other
load ticks less often and seems cheaper. The bench therefore runs it at nice -10 and counts its
ticks the way systemd would: it is the daemon's ``NOTIFY_SOCKET`` with a watchdog so short that
the daemon pings ``WATCHDOG=1`` after every completed tick (under systemd, ``WatchdogSec=30s``, it
pings every 15 s: the bench's pings cost the daemon about 0.05 to 0.08 ms a tick that a host does
not pay). The table gives the CPU share, the ticks per second reached (10 is on time), the CPU per
tick, and the CPU per tick of the loop's own thread (the main thread: without the adoption scan's
and the other threads').

MPS is simulated by default (``mps.control_binary`` names no binary), so the figure is the
daemon's loop; ``--mps-control PATH`` runs NVIDIA's real control daemon per simulated GPU, as a
GPU host would, and adds its health checks (a front-end process every ``mps.health_period``).

The clients are submitted over the daemon's socket with the request ``gpushare submit --offline
--detach -- sleep 600`` sends (the CLI's own start-up would only slow the set-up). A GPU holds at
most ``mps.max_clients`` MPS clients, the latency probe included, and the daemon refuses a submit
beyond that; the bench sets it to 128, the most the config allows (the default is 48), so one GPU
holds 127 idle clients and the rest of 200 are refused: the table says how many run. The daemon
places idle clients (no GPU memory used) on the GPU with the fewest clients (docs/design.md D12),
one per GPU in turn; ``--spread`` submits client i to GPU i mod N, the same spread named
explicitly. Results written before D12 (``"placement": "by the daemon (GPU 0)"``) had every
placed client on GPU 0 and the other GPUs empty.

Before and after in one run: ``--against TREE`` runs each cell also with the daemon of another
checkout (its own ``TREE/.venv/bin/python``, its own sources), ``--repeat N`` times each, the two
alternated (ABBA: this, that, that, this, ...) so load that drifts during the run falls on both;
the table ends with each side's median and the median of the pairs' differences. The CPU per
tick is the figure least moved by other load on the host (a starved daemon ticks less often, and
its share of a core falls with its ticks).

The metrics exporter is off by default (the figures above are the loop's); ``--metrics`` turns it
on (the config's default) on a free local port, so what a tick does for it is counted too. The
bench does not scrape: the snapshot is built and rendered at a scrape (docs/benchmarks.md).

Usage: ``.venv/bin/python bench/daemon_overhead.py [--gpus 1,8] [--clients 6,48,200]
[--window 20] [--settle 5] [--mps-control PATH] [--adopt-scan-period S] [--spread] [--metrics]
[--against TREE [--repeat N]] [--out bench/results/daemon_overhead.json]``.
Needs root and a writable cgroup v2 (the pauser is the point); every process and cgroup it made
is removed at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree  # noqa: E402
from bench.support.trees import tree_commit  # noqa: E402
from bench.support.trusted import make_trusted_dir  # noqa: E402
from gpushare import protocol  # noqa: E402
from gpushare.client import ApiClient, ApiError  # noqa: E402
from gpushare.node.cgroups.discovery import own_cgroup  # noqa: E402

GPUSHARE_MAIN = "from gpushare.cli.app import main; main()"
CLK_TCK = os.sysconf("SC_CLK_TCK")
RESULTS = REPO / "bench" / "results" / "daemon_overhead.json"
MAX_CLIENTS = 128  # the most mps.max_clients allows


def cpu_ticks(pid: int, tid: int | None = None) -> tuple[int, int]:
    """(utime + stime, cutime + cstime) of ``pid`` in clock ticks, from /proc/PID/stat.

    With ``tid``, of that one thread (/proc/PID/task/TID/stat; its children's are 0).
    """
    where = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    text = Path(where).read_text()
    # The command name may hold spaces and parentheses: the fields start after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return utime + stime, cutime + cstime


def free_port() -> int:
    """A local TCP port free now (the exporter binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def write_config(
    base: Path,
    cgroup_dir: Path,
    mps_control: str,
    scan_period_s: float | None = None,
    metrics: bool = False,
) -> Path:
    path = base / "gpushare.toml"
    # A scan period far beyond the window leaves the adoption scan out: what the rest costs.
    scan = "" if scan_period_s is None else f'adopt_scan_period = "{scan_period_s}s"\n'
    exporter = (
        f'enabled = true\nlisten = "127.0.0.1:{free_port()}"' if metrics else "enabled = false"
    )
    path.write_text(
        f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
cgroup_base = "{cgroup_dir}"
[daemon]
admin_group = ""
{scan}[metrics]
{exporter}
[mps]
control_binary = "{mps_control}"
max_clients = {MAX_CLIENTS}
"""
    )
    return path


class TickCounter:
    """A stand-in for systemd's notify socket that timestamps every ``WATCHDOG=1`` ping."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.pings: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if b"WATCHDOG=1" in data.split(b"\n"):
                self.pings.append(time.monotonic())

    def between(self, t0: float, t1: float) -> int:
        return sum(1 for t in list(self.pings) if t0 <= t < t1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def _start_daemon(
    python: str, tree: Path, gpus: int, config: Path, env: dict[str, str], log: IO[bytes]
) -> subprocess.Popen[bytes]:
    """``gpushare daemon --simulate`` of ``tree``, niced so that the bench's own load waits."""
    return subprocess.Popen(
        [
            "nice",
            "-n",
            "-10",
            python,
            "-c",
            GPUSHARE_MAIN,  # run in tree: its own sources come first on sys.path
            "daemon",
            "--simulate",
            str(gpus),
            "--config",
            str(config),
        ],
        env=env,
        cwd=tree,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )


def _wait_for_socket(proc: subprocess.Popen[bytes], sock: Path, log_path: Path) -> None:
    """Return once the daemon's socket exists; raise if it exits or takes over 60 s."""
    deadline = time.monotonic() + 60
    while not sock.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited: {log_path.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("the daemon did not open its socket within 60 s")
        time.sleep(0.1)


def _submit_idle(api: ApiClient, clients: int, gpus: int, spread: bool) -> int:
    """Submit ``clients`` idle offline clients; how many were refused (the node full)."""
    refused = 0
    queue_flag = True
    for i in range(clients):
        if refused:
            refused += 1  # the node is full: the rest would be refused too
            continue
        # Without --spread the daemon places every client: idle sleeps use no GPU memory,
        # so free memory ties and the fewest-clients rule spreads them (docs/design.md D12).
        where = str(i % gpus) if spread else "any"
        request = {
            "cls": "offline",
            "argv": ["sleep", "600"],
            "name": f"idle-{i}",
            "gpu": where,
            "detach": True,
            "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            "cwd": "/",
            # Refused, not queued, when the node is full: the figure is of idle clients.
            **({"no_queue": True} if queue_flag else {}),
        }
        try:
            api.call(protocol.SUBMIT, request)
        except ApiError as exc:
            if "unknown parameter" in exc.message and queue_flag:
                queue_flag = False  # a daemon from before the queue: it refuses anyway
                request.pop("no_queue")
                api.call(protocol.SUBMIT, request)
                continue
            if exc.code is not protocol.ErrorCode.NO_CAPACITY:
                raise
            refused = 1
    return refused


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the daemon, then kill it after 20 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_cell(gpus: int, clients: int, args: argparse.Namespace, tree: Path) -> dict[str, Any]:
    """One daemon of ``tree`` (its ``.venv``'s Python; this one's for this checkout) measured."""
    base = make_trusted_dir("gsb-")  # not /tmp: the daemon refuses a config there
    own = own_cgroup()
    assert own is not None
    cgroup_dir = own / f"gs-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    config = write_config(
        base, cgroup_dir, args.mps_control, args.adopt_scan_period, metrics=args.metrics
    )
    python = sys.executable if tree == REPO else str(tree / ".venv" / "bin" / "python")
    sock = base / "run" / "gpushare.sock"
    ticks = TickCounter(base / "notify.sock")
    # WATCHDOG_USEC=1: the daemon pings after every tick (it pings at half the period, at most
    # once per completed tick).
    env = {
        **os.environ,
        "GPUSHARE_SOCKET": str(sock),
        "NOTIFY_SOCKET": str(ticks.path),
        "WATCHDOG_USEC": "1",
    }
    log = (base / "daemon.log").open("wb")
    proc = _start_daemon(python, tree, gpus, config, env, log)
    try:
        _wait_for_socket(proc, sock, base / "daemon.log")
        t_submit = time.monotonic()
        with ApiClient.connect(sock, name="bench") as api:
            refused = _submit_idle(api, clients, gpus, args.spread)
            submit_s = time.monotonic() - t_submit
            time.sleep(args.settle)
            states: dict[str, int] = {}
            for c in api.call(protocol.LIST, {})["clients"]:
                states[c["state"]] = states.get(c["state"], 0) + 1
        t0 = time.monotonic()
        # The main thread is the loop's (its tid is the pid): the ticks' own cost, without the
        # adoption scan's and the other threads'.
        own0, kids0 = cpu_ticks(proc.pid)
        loop0, _ = cpu_ticks(proc.pid, proc.pid)
        time.sleep(args.window)
        own1, kids1 = cpu_ticks(proc.pid)
        loop1, _ = cpu_ticks(proc.pid, proc.pid)
        t1 = time.monotonic()
        wall = t1 - t0
        loop_ticks = ticks.between(t0, t1)
        if proc.poll() is not None:
            raise RuntimeError("the daemon exited during the window")
        threads = len(os.listdir(f"/proc/{proc.pid}/task"))
    finally:
        _stop(proc)
        log.close()
        ticks.close()
        # The daemon leaves its workloads running when it stops (they are not its to kill).
        remove_tree(cgroup_dir, timeout_s=10.0)
        shutil.rmtree(base, ignore_errors=True)
    cpu_pct = 100.0 * (own1 - own0) / CLK_TCK / wall
    children_pct = 100.0 * (kids1 - kids0) / CLK_TCK / wall
    return {
        "tree": tree.name,
        "commit": tree_commit(tree),
        "gpus": gpus,
        "clients": clients,
        "cpu_pct_of_one_core": round(cpu_pct, 2),
        "ticks_per_s": round(loop_ticks / wall, 2),
        "cpu_ms_per_tick": round(1e3 * (own1 - own0) / CLK_TCK / max(1, loop_ticks), 3),
        "loop_thread_cpu_pct": round(100.0 * (loop1 - loop0) / CLK_TCK / wall, 2),
        "loop_cpu_ms_per_tick": round(1e3 * (loop1 - loop0) / CLK_TCK / max(1, loop_ticks), 3),
        "children_cpu_pct": round(children_pct, 2),
        "window_s": round(wall, 2),
        "cpu_s": round((own1 - own0) / CLK_TCK, 2),
        "states": states,
        "refused": refused,
        "threads": threads,
        "submit_s": round(submit_s, 2),
    }


def print_row(cell: dict[str, Any]) -> None:
    states = ", ".join(f"{v} {k}" for k, v in sorted(cell["states"].items()))
    if cell["refused"]:
        states += f"; {cell['refused']} refused (GPU full)"
    print(
        f"{cell['side']:>7} {cell['gpus']:>4} {cell['clients']:>7} "
        f"{cell['cpu_pct_of_one_core']:>15.2f} {cell['ticks_per_s']:>7.2f} "
        f"{cell['cpu_ms_per_tick']:>11.3f} {cell['loop_cpu_ms_per_tick']:>12.3f} "
        f"{cell['children_cpu_pct']:>10.2f}  {states}",
        flush=True,
    )


def compare(
    gpus: int, clients: int, this: list[dict[str, Any]], that: list[dict[str, Any]]
) -> dict[str, Any]:
    """Each side's medians and the median of the pairs' differences (this minus against)."""
    out: dict[str, Any] = {"gpus": gpus, "clients": clients, "pairs": len(this)}
    for key in ("cpu_pct_of_one_core", "cpu_ms_per_tick", "loop_cpu_ms_per_tick"):
        out[key] = {
            "this": [c[key] for c in this],
            "against": [c[key] for c in that],
            "median_this": round(statistics.median(c[key] for c in this), 3),
            "median_against": round(statistics.median(c[key] for c in that), 3),
            "median_pair_change": round(
                statistics.median(a[key] - b[key] for a, b in zip(this, that, strict=True)), 3
            ),
        }
    return out


def print_comparison(row: dict[str, Any]) -> None:
    parts = []
    for key, label, digits in (
        ("cpu_pct_of_one_core", "CPU %", 2),
        ("cpu_ms_per_tick", "CPU ms/tick", 3),
        ("loop_cpu_ms_per_tick", "loop ms/tick", 3),
    ):
        m = row[key]
        parts.append(
            f"{label}: this {m['median_this']:.{digits}f}, against {m['median_against']:.{digits}f}"
            f" (pairs {m['median_pair_change']:+.{digits}f})"
        )
    print(
        f"{'median':>7} {row['gpus']:>4} {row['clients']:>7}  "
        + "; ".join(parts)
        + f"; {row['pairs']} pair(s)",
        flush=True,
    )


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1,8", help="simulated GPU counts, comma-separated")
    ap.add_argument("--clients", default="6,48,200", help="idle client counts, comma-separated")
    ap.add_argument("--window", type=float, default=20.0, help="measured window, seconds")
    ap.add_argument("--settle", type=float, default=5.0, help="wait after the last submit, s")
    ap.add_argument(
        "--mps-control",
        default="/nonexistent/gpushare-bench/nvidia-cuda-mps-control",
        help="the MPS control binary; the default names none, so MPS is simulated",
    )
    ap.add_argument(
        "--adopt-scan-period",
        type=float,
        help="daemon.adopt_scan_period in seconds (default: the config's); 3600 leaves the scan out",
    )
    ap.add_argument(
        "--spread",
        action="store_true",
        help="submit client i to GPU i mod N (default: the daemon places them, D12)",
    )
    ap.add_argument(
        "--metrics", action="store_true", help="turn the metrics exporter on (a free local port)"
    )
    ap.add_argument(
        "--against",
        type=Path,
        metavar="TREE",
        help="also run each cell with the daemon of this checkout (TREE/.venv/bin/python)",
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs of each cell on each side, alternated"
    )
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    return ap


def _run_cells(
    args: argparse.Namespace, sides: list[tuple[str, Path]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every cell on every side (alternated, ABBA), printed as it ends; and their comparisons."""
    cells: list[dict[str, Any]] = []
    compared: list[dict[str, Any]] = []
    print(
        f"{'side':>7} {'GPUs':>4} {'clients':>7} {'CPU % of a core':>15} {'ticks/s':>7} "
        f"{'CPU ms/tick':>11} {'loop ms/tick':>12} {'children %':>10}  states"
    )
    for gpus in (int(x) for x in args.gpus.split(",")):
        for clients in (int(x) for x in args.clients.split(",")):
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in sides}
            for r in range(args.repeat):
                # ABBA: each side goes first every other time, so a drift in load is shared.
                for name, tree in sides if r % 2 == 0 else sides[::-1]:
                    cell = {"side": name, **run_cell(gpus, clients, args, tree)}
                    cells.append(cell)
                    runs[name].append(cell)
                    print_row(cell)
            if len(sides) > 1:
                compared.append(compare(gpus, clients, runs["this"], runs["against"]))
                print_comparison(compared[-1])
    return cells, compared


def main() -> int:
    ap = _parser()
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be 1 or more")
    reason = cgroup_skip_reason()
    if reason is not None:
        # Skipped, not failed: `make bench` runs every bench, also where it cannot run this one.
        print(f"daemon_overhead: skipped ({reason}; the real cgroup pauser is what it measures)")
        return 0
    mps = "real" if shutil.which(args.mps_control) else "simulated"
    sides = [("this", REPO)]
    if args.against is not None:
        against = args.against.resolve()
        if not (against / ".venv" / "bin" / "python").exists():
            print(f"daemon_overhead: {against} has no .venv/bin/python to run its daemon with")
            return 2
        sides.append(("against", against))
    cells, compared = _run_cells(args, sides)
    out = {
        "bench": "daemon_overhead",
        "what": "CPU share of one core of an idle `gpushare daemon --simulate N` with M idle "
        "offline clients (sleep 600), real cgroup v2 pauser, from /proc/PID/stat",
        "mps": mps,
        "placement": "round-robin over the GPUs" if args.spread else "by the daemon (D12)",
        "window_s": args.window,
        "settle_s": args.settle,
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_at_end": list(os.getloadavg()),
        },  # fmt: skip
        "cells": cells,
        **({"against": args.against.resolve().name, "compared": compared} if compared else {}),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
