"""CLI start-up: wall time of every command, this tree against another one, in the same run.

Each command runs as a whole process (``python -m gpushare ...``) with ``PYTHONPATH`` set to the
tree under test, alternating between the two trees so that load on the machine falls on both
alike; the median of ``--runs`` (default 10) is reported per command and tree. Commands that talk
to the daemon ask a real one (tests/support/daemon_proc.py: fake GPUs, everything else real) that
this script starts under /tmp; ``submit --detach`` runs ``true`` on it. Prints a table and writes
bench/results/cli_startup.json. The target (issue 29) is 150 ms or less for every command.

    git worktree add /tmp/old b0c0ecb
    .venv/bin/python bench/cli_startup.py --against /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.daemon_helpers import REPO, DaemonProc
from bench.support.trees import tree_commit

OUT = REPO / "bench" / "results" / "cli_startup.json"
TARGET_MS = 150.0

COMMANDS: tuple[tuple[str, ...], ...] = (
    ("--help",),
    ("-h",),
    ("submit", "--help"),
    ("status",),
    ("status", "--json"),
    ("list", "--json"),
    ("list", "--all"),
    ("events", "--limit", "5"),
    ("submit", "--offline", "--detach", "--", "true"),
    ("doctor", "--help"),
    ("env", "--help"),
    ("sim", "--help"),
    ("sim", "--list"),
    ("config", "check", "--help"),
    ("daemon", "--help"),
    ("completion", "bash"),
)


def _run(tree: Path, args: tuple[str, ...], env: dict[str, str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "gpushare", *args], cwd="/", capture_output=True, timeout=120,
        check=False, env={**env, "PYTHONPATH": str(tree)},
    )  # fmt: skip
    return time.perf_counter() - t0, r.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--against", type=Path, help="Another tree (e.g. a worktree of b0c0ecb).")
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    trees = {"this": REPO, **({"against": args.against.resolve()} if args.against else {})}
    d = DaemonProc(gpus=2)
    rows = []
    try:
        d.start()
        env = {**os.environ, "GPUSHARE_SOCKET": str(d.socket), "NO_COLOR": "1"}
        env.pop("PYTHONPATH", None)
        for command in COMMANDS:
            times: dict[str, list[float]] = {name: [] for name in trees}
            codes: dict[str, set[int]] = {name: set() for name in trees}
            for _ in range(args.runs):
                for name, tree in trees.items():  # alternate: the same load on both
                    wall, code = _run(tree, command, env)
                    times[name].append(wall)
                    codes[name].add(code)
            rows.append({
                "command": "gpushare " + " ".join(command),
                **{f"{n}_median_ms": round(statistics.median(t) * 1e3, 1) for n, t in times.items()},
                **{f"{n}_exit": sorted(c) for n, c in codes.items()},
            })  # fmt: skip
    finally:
        d.cleanup()
    head = f"{'command':<50}" + "".join(f"{n + ' ms':>14}" for n in trees)
    print(head)
    for r in rows:
        print(f"{r['command']:<50}" + "".join(f"{r[f'{n}_median_ms']:>14}" for n in trees))
    worst = max(r["this_median_ms"] for r in rows)
    print(f"slowest command here: {worst} ms (target {TARGET_MS:g} ms, median of {args.runs})")
    result = {
        "host_cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "python": sys.version.split()[0],
        "runs": args.runs,
        "trees": {n: tree_commit(t) for n, t in trees.items()},
        "target_ms": TARGET_MS,
        "commands": rows,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
