"""Abuse of a shared host's daemon, measured: what one user can do to the others.

Socket part (issue 27 item 6): one unprivileged account (the holder) opens N idle connections to
the API socket (default 10,000; the holder raises its RLIMIT_NOFILE to its hard limit) and keeps
them open saying nothing, while a second unprivileged account (the victim) and root ask for
``status`` again and again, each call on a fresh connection with ``hello`` first, as the CLI does.
The figure is the victim's ``status`` latency (p50, p99, max) and how many of its calls failed;
the issue's bound is p99 under 200 ms.

Two rows:

- ``default``: the shipped limits. The per-uid limit (``daemon.max_connections_per_uid``, 64)
  refuses the holder's connections beyond it at once, with a BUSY answer: the row says how many
  it holds and how many were refused.
- ``held``: the per-uid and total limits raised above N (and the daemon's RLIMIT_NOFILE with
  prlimit), so the daemon really keeps N idle connections open: what they cost the others.

A baseline without the holder comes first. A real daemon (tests/support/daemon_proc.py: fake GPUs
and MPS, everything else real) runs under /tmp; the two accounts are made and removed by
bench/support/accounts.py. Needs root.

Fuzz part: ``bench/fuzz.py`` (10^5 datagrams and 10^5 API frames from an unprivileged account
against a live simulated daemon: crashes, dead threads, tracebacks, RSS before and after). Faults
part: ``bench/registry_faults.py`` (kill -9 at every step of a restart, a locked database, a full
disk and a read-only state directory at start and while running, a damaged database: clients
lost, good databases renamed, ids reused). Each runs as its own script too; here their JSON is
folded in.

    .venv/bin/python bench/abuse.py [--parts socket,fuzz,faults] [--connections 10000]
        [--calls 300] [--rows default,held] [--out bench/results/abuse.json]

The JSON holds one key per part (``socket``, ``fuzz``, ``faults``); a run replaces the parts it
ran and keeps the others'.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.support import accounts  # noqa: E402
from bench.support.daemon_helpers import DaemonProc, python_for_others  # noqa: E402
from bench.support.holder import HOLDER  # noqa: E402

OUT = REPO / "bench" / "results" / "abuse.json"

# Each call on a new connection (hello, then status), as `gpushare status` makes it.
PROBE = r"""
import json, socket, sys, time
path, calls = sys.argv[1], int(sys.argv[2])
lat, errors = [], {}
for _ in range(calls):
    t0 = time.perf_counter()
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(path)
        f = s.makefile("rwb")
        for i, m in enumerate(("hello", "status")):
            p = {"api_version": 1} if m == "hello" else {}
            f.write(json.dumps({"id": i, "method": m, "params": p}).encode() + b"\n")
            f.flush()
            reply = json.loads(f.readline())
            if "error" in reply:
                raise RuntimeError(reply["error"]["name"])
        s.close()
        lat.append(time.perf_counter() - t0)
    except Exception as exc:
        errors[str(exc)[:80]] = errors.get(str(exc)[:80], 0) + 1
    time.sleep(0.01)
print(json.dumps({"lat": lat, "errors": errors}))
"""


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0, 2)


def probe(python: str, account: accounts.Account | None, sock: Path, calls: int) -> dict[str, Any]:
    """The ``status`` latency of ``calls`` calls from ``account`` (root when None)."""
    who = {} if account is None else {"user": account.uid, "group": account.gid, "extra_groups": []}
    out = subprocess.run(
        [python, "-c", PROBE, str(sock), str(calls)],
        cwd="/", capture_output=True, text=True, timeout=600, check=True, **who,
    )  # fmt: skip
    data = json.loads(out.stdout)
    lat = data["lat"]
    return {
        "calls": calls,
        "failed": sum(data["errors"].values()),
        "errors": data["errors"],
        "p50_ms": _pct(lat, 0.50),
        "p99_ms": _pct(lat, 0.99),
        "max_ms": round(max(lat) * 1000.0, 2) if lat else None,
    }


def daemon_fds(d: DaemonProc) -> int:
    assert d.proc is not None
    return len(list(Path(f"/proc/{d.proc.pid}/fd").iterdir()))


def run_row(
    name: str, daemon_toml: str, n: int, calls: int, python: str, holder: accounts.Account,
    victim: accounts.Account,
) -> dict[str, Any]:  # fmt: skip
    d = DaemonProc(daemon_toml=daemon_toml, gpus=2)
    d.start()
    try:
        assert d.proc is not None
        # The daemon's own descriptor limit must allow N connections, or EMFILE refuses them.
        resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (n + 1024, n + 1024))
        row: dict[str, Any] = {"row": name, "connections_tried": n}
        if name == "default":
            row["baseline_victim"] = probe(python, victim, d.socket, calls)
        h = subprocess.Popen(
            [python, "-c", HOLDER, str(d.socket), str(n), "2.0"], cwd="/", user=holder.uid,
            group=holder.gid, extra_groups=[], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            assert h.stdout is not None
            held = json.loads(h.stdout.readline())
            row["holder"] = held
            row["held_by_daemon"] = held["connected"] - held["refused"]
            row["daemon_fds"] = daemon_fds(d)
            row["victim"] = probe(python, victim, d.socket, calls)
            row["root"] = probe(python, None, d.socket, calls // 3)
            row["daemon_threads"] = len(list(Path(f"/proc/{d.proc.pid}/task").iterdir()))
        finally:
            h.communicate(timeout=60)
        return row
    finally:
        d.cleanup()


def run_script(name: str, args: list[str], out: Path) -> dict[str, Any]:
    """Run another bench of this folder and return the JSON it wrote to ``out``."""
    print(f"== bench/{name} {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, str(REPO / "bench" / name), *args], check=True)
    data: dict[str, Any] = json.loads(out.read_text())
    data["command"] = f"bench/{name} {' '.join(args)}".strip()
    return data


def other_parts(wanted: list[str]) -> dict[str, dict[str, Any]]:
    """The fuzz and faults parts, run by their own benches, with their one-line summaries."""
    parts: dict[str, dict[str, Any]] = {}
    results = REPO / "bench" / "results"
    if "fuzz" in wanted:
        f = parts["fuzz"] = run_script("fuzz.py", [], results / "fuzz.json")
        print(f"fuzz: crashed {f['daemon_crashed']}, dead threads {f['dead_threads']}, "
              f"restarts {f['thread_restarts']}, tracebacks {f['tracebacks_in_log']}, "
              f"RSS {f['rss_kib_before']} -> {f['rss_kib_after']} KiB")  # fmt: skip
    if "faults" in wanted:
        f = parts["faults"] = run_script("registry_faults.py", ["--rounds", "3"],
                                         results / "registry_faults.json")  # fmt: skip
        print(f"faults: {f['faults_injected']} injected, clients lost {f['clients_lost']}, "
              f"good databases renamed {f['good_databases_renamed']}, "
              f"ids reused {f['client_ids_reused']}")  # fmt: skip
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="socket,fuzz,faults", help="socket, fuzz, faults")
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--rows", default="default,held", help="which rows: default, held or both")
    args = ap.parse_args()
    parts = args.parts.split(",")
    result: dict[str, Any] = {"bench": "abuse"}
    if args.out.exists():
        result = json.loads(args.out.read_text())
    if "socket" in parts:
        result["socket"] = socket_part(args)
    result.update(other_parts(parts))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def socket_part(args: argparse.Namespace) -> dict[str, Any]:
    """Idle connections held by one account while another asks for ``status``."""
    reason = accounts.skip_reason()
    python = python_for_others()
    if reason is not None or python is None:
        sys.exit(f"bench/abuse.py: {reason or 'no Python interpreter other uids may run'}")
    n = args.connections
    # The holder inherits the hard limit from here and raises its soft limit to it.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < n + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, n + 64))
    accounts.remove_stale()
    holder, victim = accounts.create("hv")
    rows = []
    try:
        wanted = args.rows.split(",")
        if "default" in wanted:
            rows.append(run_row("default", "", n, args.calls, python, holder, victim))
        if "held" in wanted:
            raised = (
                f"max_connections = {n + 200}\nmax_connections_per_uid = {n + 100}\n"
                'idle_timeout = "1h"\n'
            )
            rows.append(run_row("held", raised, n, args.calls, python, holder, victim))
    finally:
        accounts.remove(holder.name)
        accounts.remove(victim.name)
    print(f"{'row':8} {'tried':>6} {'held':>6} {'refused':>7} {'fds':>6} {'thr':>4} "
          f"{'victim p50/p99/max ms':>24} {'fail':>4} {'root p99':>8}")  # fmt: skip
    for r in rows:
        v = {k: str(x) for k, x in r["victim"].items()}
        print(
            f"{r['row']:8} {r['connections_tried']:>6} {r['held_by_daemon']:>6} "
            f"{r['holder']['refused']:>7} {r['daemon_fds']:>6} {r['daemon_threads']:>4} "
            f"{v['p50_ms']:>7}/{v['p99_ms']:>7}/{v['max_ms']:>7} {v['failed']:>4} "
            f"{r['root']['p99_ms']!s:>8}"
        )
    base = rows[0].get("baseline_victim")
    if base is not None:
        print(f"baseline (no holder): victim p50 {base['p50_ms']} ms, p99 {base['p99_ms']} ms")
    return {
        "command": "bench/abuse.py " + " ".join(sys.argv[1:]),
        "host": {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version()},
        "bound_p99_ms": 200.0,
        "rows": rows,
    }


if __name__ == "__main__":
    main()
