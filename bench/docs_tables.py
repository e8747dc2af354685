"""Regenerate docs/benchmarks.md's tables that are pure functions of bench/results/*.json.

Each generated table sits between two marker lines in the Markdown::

    <!-- generated: bench/docs_tables.py NAME from bench/results/a.json, ... -->
    ...
    <!-- end generated -->

and only what lies between them is rewritten (the opening marker too, so that it names the JSON
files the block is made from); prose and historical tables outside the markers are never touched.
Every block this script knows must be in the document once, and every marker must name a block it
knows, so a deleted or misspelt marker fails the check instead of leaving a table unchecked.

    .venv/bin/python bench/docs_tables.py            # rewrite the blocks after rerunning a bench
    .venv/bin/python bench/docs_tables.py --check    # print the diff, exit 1 if the doc is stale

``tests/test_docs_tables.py`` runs the check, so a committed JSON and the doc cannot disagree.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without the package installed
    sys.path.insert(0, str(ROOT))

from gpushare.sim import report  # noqa: E402


def _frontier_module() -> Any:
    # bench/ is no package and stays off sys.path (its scripts' names would shadow modules of
    # whoever imports this one, the tests); the pair selection and row name are frontier.py's.
    path = ROOT / "bench" / "frontier.py"
    spec = importlib.util.spec_from_file_location("_bench_frontier", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_FRONTIER = _frontier_module()
NO_GATING: str = _FRONTIER.NO_GATING
PAIR_PREFIXES: tuple[str, ...] = _FRONTIER.PAIR_PREFIXES

DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"
TOOL = "bench/docs_tables.py"
OPEN = f"<!-- generated: {TOOL} "
END = "<!-- end generated -->"

#: SLO factor (as the docs write it) -> bench/sharing.py output with every policy, gating on.
SHARING = {
    "1.05x": "sharing-slo1.05.json",
    "1.1x": "sharing.json",
    "1.5x": "sharing-slo1.5.json",
    "2x": "sharing-slo2.json",
}
#: The same factors, ``--policy gpushare --no-gating``.
NOGATING = {
    "1.05x": "sharing-slo1.05-nogating.json",
    "1.1x": "sharing-slo1.1-nogating.json",
    "1.5x": "sharing-slo1.5-nogating.json",
    "2x": "sharing-slo2-nogating.json",
}
#: bench/frontier.py's factor keys, in the tables' column order.
FRONTIER_FACTORS = ("1.05", "1.1", "1.5", "2")
#: Summary fields that cannot depend on the SLO factor for a policy that ignores the SLO (every
#: baseline): the tightness table prints them once per baseline, so they are checked equal.
FACTOR_FREE = (
    "p99_overhead_mean",
    "p99_overhead_median",
    "p99_overhead_worst",
    "within_7pct",
    "offline_norm_mean",
    "system_throughput_mean",
    "busy_mean",
)


class DocError(Exception):
    """The document's markers or the JSON cannot give the tables; the message names the fix."""


class Results:
    """JSON files of one results folder, each read once."""

    def __init__(self, folder: Path, allowed: frozenset[str] | None = None) -> None:
        self.folder = folder
        self.allowed = allowed
        self._cache: dict[str, Any] = {}

    def only(self, names: Sequence[str]) -> Results:
        """A view that reads only ``names`` (a block's marker names its files: it gets no other)."""
        view = Results(self.folder, frozenset(names))
        view._cache = self._cache
        return view

    def __call__(self, name: str) -> Any:
        if self.allowed is not None and name not in self.allowed:
            raise DocError(f"{name}: read by a block whose sources do not name it (a bug here)")
        if name not in self._cache:
            path = self.folder / name
            try:
                self._cache[name] = json.loads(path.read_text())
            except FileNotFoundError:
                raise DocError(f"{path}: missing; rerun the bench that writes it") from None
            except json.JSONDecodeError as e:
                raise DocError(f"{path}: not JSON ({e})") from None
        return self._cache[name]

    def summary(self, name: str) -> dict[str, dict[str, Any]]:
        """``bench/sharing.py``'s per-policy summary rows of ``name``, by policy."""
        return {r["policy"]: r for r in self(name)["summary"]}


def _pct(v: float, digits: int = 0) -> str:
    return f"{v * 100:+.{digits}f}%"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


_SUMMARY_HEAD = (
    "p99 overhead mean",
    "median",
    "worst",
    "scenarios within 7 %",
    "SLO attainment",
    "offline tput",
    "system tput",
    "GPU busy",
)


def _summary_cells(r: dict[str, Any], digits: int = 0, attainment: str | None = None) -> list[str]:
    return [
        _pct(r["p99_overhead_mean"], digits),
        _pct(r["p99_overhead_median"], digits),
        _pct(r["p99_overhead_worst"], digits),
        f"{r['within_7pct']}/{r['scenarios']}",
        attainment or f"{r['slo_attainment_mean'] * 100:.2f}%",
        f"{r['offline_norm_mean']:.2f}",
        f"{r['system_throughput_mean']:.2f}",
        f"{r['busy_mean'] * 100:.0f}%",
    ]


def sharing_summary(res: Results) -> list[str]:
    """The "Summary per policy (SLO 1.1x)" table: every policy, then gpushare `--no-gating`."""
    rows = [[p, *_summary_cells(r)] for p, r in res.summary(SHARING["1.1x"]).items()]
    nog = res.summary(NOGATING["1.1x"])["gpushare"]
    rows.append(["gpushare without gating (`--no-gating`)", *_summary_cells(nog)])
    return _table(("policy", *_SUMMARY_HEAD), rows)


def sharing_tightness(res: Results) -> list[str]:
    """The SLO-tightness table: gpushare with and without gating per factor, then one row per
    baseline with its attainment at each factor (the rest does not move with the factor)."""
    head = ["SLO", "policy", *_SUMMARY_HEAD]
    head[head.index("scenarios within 7 %")] = "within 7 %"
    rows = [
        [f, "**gpushare**", *_summary_cells(res.summary(n)["gpushare"], 1)]
        for f, n in SHARING.items()
    ]
    rows += [
        [f, "gpushare without gating", *_summary_cells(res.summary(n)["gpushare"], 1)]
        for f, n in NOGATING.items()
    ]
    per = {f: res.summary(n) for f, n in SHARING.items()}
    base = per["1.1x"]
    for policy, r in base.items():
        if policy == "gpushare":
            continue
        for f, summ in per.items():
            moved = [k for k in FACTOR_FREE if summ[policy][k] != r[k]]
            if moved:
                raise DocError(
                    f"{policy}: {', '.join(moved)} at {f} ({SHARING[f]}) differ from 1.1x: the "
                    "tightness table prints one row per baseline; give it a row per factor"
                )
        att = " / ".join(f"{per[f][policy]['slo_attainment_mean'] * 100:.2f}" for f in per) + "%"
        rows.append([" / ".join(per), policy, *_summary_cells(r, 0, att)])
    return _table(head, rows)


def _tally_pair(scenario: str) -> bool:
    return scenario.startswith(tuple(f"pair-{p}" for p in PAIR_PREFIXES))


def sharing_pairs(res: Results) -> list[str]:
    """p99 over p99 alone (latency and service time), median and worst, on the Tally-shaped
    pairs and on all pairs, per policy, from ``sharing.json``'s rows."""
    doc = res(SHARING["1.1x"])
    rows = []
    for policy in res.summary(SHARING["1.1x"]):
        cells = [policy]
        for tally_only in (True, False):
            runs = [
                r
                for sc in doc["scenarios"]
                if sc["scenario"].startswith("pair-")
                and (not tally_only or _tally_pair(sc["scenario"]))
                for r in sc["rows"]
                if r["policy"] == policy
            ]
            for key in ("p99_overhead", "service_overhead"):
                ratios = [r[key] + 1.0 for r in runs]
                cells += [f"{statistics.median(ratios):.2f}x", f"{max(ratios):.1f}x"]
        rows.append(cells)
    n_tally = sum(_tally_pair(sc["scenario"]) for sc in doc["scenarios"])
    n_pairs = sum(sc["scenario"].startswith("pair-") for sc in doc["scenarios"])
    head = (
        "policy",
        f"{n_tally} Tally-shaped pairs: latency median",
        "worst",
        "service median",
        "worst",
        f"all {n_pairs} pairs: latency median",
        "worst",
        "service median",
        "worst",
    )
    return _table(head, rows)


def sharing_every(res: Results) -> list[str]:
    """The "Every scenario" table: ``sharing.json``'s rows as ``bench/sharing.py`` writes them in
    ``sharing.md`` (the same formatter)."""
    rows = [report.Row(**r) for sc in res(SHARING["1.1x"])["scenarios"] for r in sc["rows"]]
    return report.markdown_table(rows, with_scenario=True).split("\n")


#: Row labels of the frontier tables: bench/frontier.py's policy -> (label, bold cells).
_FRONTIER_LABELS = {
    NO_GATING: ("gpushare (no gating): before", False),
    "gpushare": ("**gpushare (gating + delay, trust 60 s)**: now", True),
}


def _frontier_cell(v: dict[str, float]) -> str:
    return f"{v['slo_attainment_mean'] * 100:.2f} %, {v['offline_norm_mean']:.2f}"


def _frontier_p99_cell(v: dict[str, float]) -> str:
    return f"{_pct(v['p99_overhead_mean'], 1)} ({_pct(v['p99_overhead_worst'], 1)})"


def _frontier(name: str, cell: Callable[[dict[str, float]], str]) -> Callable[[Results], list[str]]:
    def render(res: Results) -> list[str]:
        policies: dict[str, dict[str, dict[str, float]]] = res(name)["policies"]
        order = [NO_GATING, "gpushare"] + [p for p in policies if p not in _FRONTIER_LABELS]
        rows = []
        for policy in order:
            label, bold = _FRONTIER_LABELS.get(policy, (policy, False))
            cells = [label]
            for f in FRONTIER_FACTORS:
                c = cell(policies[policy][f])
                cells.append(f"**{c}**" if bold else c)
            rows.append(cells)
        return _table(("policy", *(f"{f}x" for f in FRONTIER_FACTORS)), rows)

    return render


def _range_cell(c: dict[str, Any]) -> str:
    where = (
        "inside"
        if c["low_ratio"] <= c["median_ratio"] <= c["high_ratio"]
        else f"x{c['off_by']:.2f}"
    )
    return f"{c['median_ratio']:.2f}x ({c['worst_ratio']:.1f}x) {where}"


def baseline_ranges(res: Results) -> list[str]:
    """bench/sim_pairs.py: each baseline's median (worst) p99 over alone per variant and pair set,
    latency at each run length and service time at the longest, against the hardware range."""
    runs = res("sim_pairs.json")["runs"]
    by = {
        (r["duration_s"], c["variant"], c["set"], c["baseline"], c["metric"]): c
        for r in runs
        for c in r["checks"]
    }
    lengths = [r["duration_s"] for r in runs]
    rows = []
    firsts = [k for k in by if k[0] == lengths[0] and k[4] == "latency"]
    # The shipped (host-bound) variant first, then the GPU-bound one.
    for _, variant, label, baseline, metric in sorted(
        firsts, key=lambda k: (k[1] != "host-bound", k)
    ):
        first = by[(lengths[0], variant, label, baseline, metric)]
        cells = [variant, label, baseline, f"{first['low_ratio']:g}-{first['high_ratio']:g}x"]
        cells += [_range_cell(by[(d, variant, label, baseline, "latency")]) for d in lengths]
        cells.append(_range_cell(by[(lengths[-1], variant, label, baseline, "service")]))
        rows.append(cells)
    head = ("variant", "pairs", "baseline", "hardware range")
    return _table(
        (
            *head,
            *(f"latency, {d:g} s" for d in lengths),
            f"service, {lengths[-1]:g} s",
        ),
        rows,
    )


@dataclass(frozen=True)
class Block:
    """One generated table: the JSON files (in the results folder) it is a function of."""

    sources: tuple[str, ...]
    render: Callable[[Results], list[str]]


BLOCKS: dict[str, Block] = {
    "sharing-summary": Block((SHARING["1.1x"], NOGATING["1.1x"]), sharing_summary),
    "sharing-tightness": Block(
        (*SHARING.values(), *NOGATING.values()),
        sharing_tightness,
    ),
    "sharing-pairs": Block((SHARING["1.1x"],), sharing_pairs),
    "sharing-every": Block((SHARING["1.1x"],), sharing_every),
    "frontier-pairs": Block(
        ("frontier_pairs.json",), _frontier("frontier_pairs.json", _frontier_cell)
    ),
    "frontier-pairs-p99": Block(
        ("frontier_pairs.json",), _frontier("frontier_pairs.json", _frontier_p99_cell)
    ),
    "frontier-pairs-gpubound": Block(
        ("frontier_pairs_gpubound.json",),
        _frontier("frontier_pairs_gpubound.json", _frontier_cell),
    ),
    "frontier-pairs-gpubound-p99": Block(
        ("frontier_pairs_gpubound.json",),
        _frontier("frontier_pairs_gpubound.json", _frontier_p99_cell),
    ),
    "baseline-ranges": Block(("sim_pairs.json",), baseline_ranges),
    "frontier-all": Block(("frontier.json",), _frontier("frontier.json", _frontier_cell)),
    "frontier-all-p99": Block(("frontier.json",), _frontier("frontier.json", _frontier_p99_cell)),
}


def _opening(name: str) -> str:
    files = ", ".join(f"bench/results/{s}" for s in BLOCKS[name].sources)
    return f"{OPEN}{name} from {files} -->"


def regenerate(text: str, results: Path) -> str:
    """``text`` with every generated block rebuilt from the JSON in ``results``."""
    res = Results(results)
    lines = text.split("\n")
    out: list[str] = []
    seen: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == END:
            raise DocError(f"line {i + 1}: {END} without an opening marker before it")
        if not line.startswith(OPEN):
            out.append(line)
            i += 1
            continue
        name = line[len(OPEN) :].split()[0] if line[len(OPEN) :].split() else ""
        if name not in BLOCKS:
            raise DocError(
                f"line {i + 1}: unknown generated block {name!r}; known: {', '.join(BLOCKS)}"
            )
        if name in seen:
            raise DocError(f"line {i + 1}: block {name!r} appears twice; keep one")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == END), None)
        nested = next(
            (j for j in range(i + 1, end or len(lines)) if lines[j].startswith(OPEN)), None
        )
        if end is None or nested is not None:
            raise DocError(f"line {i + 1}: block {name!r} has no {END} before the next block")
        seen.append(name)
        # Blank lines around the table: a table directly against an HTML comment is not one
        # to every Markdown renderer.
        try:
            table = BLOCKS[name].render(res.only(BLOCKS[name].sources))
        except (KeyError, TypeError, ValueError) as e:
            raise DocError(
                f"block {name!r}: {', '.join(BLOCKS[name].sources)} lack what it reads "
                f"({type(e).__name__}: {e}); rerun the bench that writes them"
            ) from None
        out += [_opening(name), "", *table, "", END]
        i = end + 1
    missing = [n for n in BLOCKS if n not in seen]
    if missing:
        raise DocError(
            f"no marker for block(s) {', '.join(missing)}: put `{OPEN}NAME -->` and `{END}` "
            "around each table"
        )
    return "\n".join(out)


def _diff(doc: Path, old: str, new: str) -> list[str]:
    lines = difflib.unified_diff(
        old.split("\n"), new.split("\n"), f"{doc} (now)", f"{doc} (from the JSON)", lineterm=""
    )
    return list(lines)


def check(doc: Path = DOC, results: Path = RESULTS) -> list[str]:
    """The unified diff from ``doc`` to what the JSON in ``results`` gives; empty if it agrees.
    Reads files only; raises `DocError` where the markers or the JSON cannot give the tables."""
    old = doc.read_text()
    return _diff(doc, old, regenerate(old, results))


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite the document's generated blocks, or with ``--check`` only report the diff."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument(
        "--check", action="store_true", help="print the diff, write nothing, exit 1 if any"
    )
    ap.add_argument("--doc", type=Path, default=DOC, help="Markdown file (default: %(default)s)")
    ap.add_argument(
        "--results", type=Path, default=RESULTS, help="JSON folder (default: %(default)s)"
    )
    args = ap.parse_args(argv)
    try:
        old = args.doc.read_text()
        new = regenerate(old, args.results)
    except (DocError, OSError) as e:
        print(f"docs_tables: {e}", file=sys.stderr)
        return 2
    diff = _diff(args.doc, old, new)
    for line in diff:
        print(line)
    if not diff:
        print(f"{args.doc}: every generated table agrees with {args.results}", file=sys.stderr)
        return 0
    if args.check:
        print(f"{args.doc}: stale; run .venv/bin/python {TOOL}", file=sys.stderr)
        return 1
    args.doc.write_text(new)
    print(f"{args.doc}: generated tables rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
