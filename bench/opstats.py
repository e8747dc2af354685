"""Cost of the control loop's operator bookkeeping (issue 17): thaw history, sync, metrics stats.

Every tick the loop calls ``OpStats.sync`` and, with metrics on, builds each live client's stats
(thawed fraction of the last minute and total); every duty edge records a freeze or thaw. This
times those per tick for 48, 192 and 384 clients (one to eight GPUs of 48 MPS clients) after a
minute of a 50 % duty cycle at the default 100 ms period, and the memory the thaw history holds.
Prints a table and writes bench/results/opstats.json.

    .venv/bin/python bench/opstats.py
"""

from __future__ import annotations

import json
import os
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpushare.daemon.opstats import OpStats, Tracked

OUT = Path(__file__).resolve().parent / "results" / "opstats.json"
PERIOD_S = 0.1
REPEATS = 50


def run(n: int) -> dict[str, float]:
    ids = [f"c{i}" for i in range(n)]
    tracemalloc.start()
    ops = OpStats()
    t = 0.0
    ops.sync([Tracked(c, live=True, thawed=True) for c in ids], t)
    for _ in range(int(60 / PERIOD_S)):  # a minute of 50 % duty: two edges a period
        for half in (True, False):
            t += PERIOD_S / 2
            for c in ids:
                ops.paused(c, half, t)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    tracked = [Tracked(c, live=True, thawed=True) for c in ids]
    t0 = time.perf_counter()
    for k in range(REPEATS):
        ops.sync(tracked, t + k * PERIOD_S)
    sync_s = (time.perf_counter() - t0) / REPEATS
    t0 = time.perf_counter()
    for k in range(REPEATS):
        for c in ids:
            ops.client_stats(c, None, 0, t + k * PERIOD_S)
    stats_s = (time.perf_counter() - t0) / REPEATS
    t0 = time.perf_counter()
    for k in range(REPEATS):
        for c in ids:
            ops.paused(c, k % 2 == 0, t + k * PERIOD_S)
    edge_s = (time.perf_counter() - t0) / REPEATS
    return {
        "clients": n,
        "sync_ms_per_tick": round(sync_s * 1e3, 3),
        "metrics_stats_ms_per_tick": round(stats_s * 1e3, 3),
        "duty_edge_ms": round(edge_s * 1e3, 3),
        "thaw_history_kib": round(memory / 1024, 1),
        "thaw_history_bytes_per_client": round(memory / n),
    }


def main() -> None:
    rows = [run(n) for n in (48, 192, 384)]
    print(f"{'clients':>8}{'sync ms':>10}{'stats ms':>10}{'edge ms':>10}{'KiB':>9}{'B/client':>10}")
    for r in rows:
        print(f"{r['clients']:>8}{r['sync_ms_per_tick']:>10}{r['metrics_stats_ms_per_tick']:>10}"
              f"{r['duty_edge_ms']:>10}{r['thaw_history_kib']:>9}"
              f"{r['thaw_history_bytes_per_client']:>10}")  # fmt: skip
    result = {"host_cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
              "period_s": PERIOD_S, "rows": rows}  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
