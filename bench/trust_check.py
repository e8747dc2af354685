"""Cost of the trust check (gpushare.trust) the daemon runs at every launch and MPS command.

Times :func:`gpushare.trust.refusal` on the in-flight library of this clone (the launch path: the
realpath, one stat per component, a cache look-up), the same on a fresh checker (every state new:
the verdict computed), and ``doctor``'s walk of the whole package. Prints the numbers and writes
them to bench/results/trust_check.json.

    .venv/bin/python bench/trust_check.py [--rounds 20000]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpushare import native, trust  # noqa: E402


def _per_call_us(fn: object, rounds: int) -> float:
    assert callable(fn)
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds * 1e6


def main() -> int:
    """Run the timings; 0 on success."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20_000)
    args = parser.parse_args()
    lib = native.library_path() if native.built() else Path(native.__file__)
    depth = len(lib.parents) + 1
    check = trust.TrustCheck()
    cached = [_per_call_us(lambda: check.refusal(lib, what="bench"), args.rounds) for _ in range(5)]
    fresh = [
        _per_call_us(lambda: trust.TrustCheck().refusal(lib, what="bench"), args.rounds // 10)
        for _ in range(5)
    ]
    package = lib.parent.parent if native.built() else Path(native.__file__).parent.parent
    walk = [_per_call_us(lambda: trust.tree_refusal(package, what="bench"), 20) for _ in range(5)]
    files = sum(1 for _ in package.rglob("*"))
    result = {
        # Relative to the clone: the JSON is committed, this machine's paths are not its business.
        "path": str(lib.relative_to(ROOT)) if lib.is_relative_to(ROOT) else lib.name,
        "components": depth,
        "refused": check.refusal(lib, what="bench"),
        "launch_check_us_median": statistics.median(cached),
        "uncached_check_us_median": statistics.median(fresh),
        "package_walk_ms_median": statistics.median(walk) / 1000,
        "package_entries": files,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(
        f"trust check of {lib} ({depth} components): {result['launch_check_us_median']:.1f} us "
        f"per launch (cached verdict), {result['uncached_check_us_median']:.1f} us uncached; "
        f"doctor's walk of {package} ({files} entries): {result['package_walk_ms_median']:.2f} ms"
    )
    out = ROOT / "bench" / "results" / "trust_check.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
