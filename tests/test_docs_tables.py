"""docs/benchmarks.md's generated tables against the committed bench/results JSON.

``bench/docs_tables.py --check`` as a function: the committed doc must be what the committed JSON
gives (file reads only), and the check must catch a JSON number or a doc cell changed on its own
(on temporary copies; the repository's files are never written).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "bench" / "docs_tables.py")
    if spec is None or spec.loader is None:
        raise ImportError("bench/docs_tables.py cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("docs_tables", module)
    spec.loader.exec_module(module)
    return module


dt = _load()


@pytest.fixture
def copy(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of docs/benchmarks.md and of the JSON files the generated blocks read."""
    doc = tmp_path / "benchmarks.md"
    shutil.copyfile(dt.DOC, doc)
    results = tmp_path / "results"
    results.mkdir()
    for name in {s for b in dt.BLOCKS.values() for s in b.sources}:
        shutil.copyfile(dt.RESULTS / name, results / name)
    return doc, results


def _edit_json(results: Path, name: str, edit: Callable[[Any], None]) -> None:
    path = results / name
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _summary(data: Any, policy: str) -> dict[str, Any]:
    row: dict[str, Any] = next(r for r in data["summary"] if r["policy"] == policy)
    return row


def test_committed_doc_agrees_with_committed_json() -> None:
    diff = dt.check()
    assert diff == [], (
        "docs/benchmarks.md is stale; run .venv/bin/python bench/docs_tables.py:\n"
        + ("\n".join(diff))
    )


def test_every_block_is_in_the_doc_once_and_names_its_json() -> None:
    text = dt.DOC.read_text()
    for name, block in dt.BLOCKS.items():
        openings = [line for line in text.split("\n") if line.startswith(f"{dt.OPEN}{name} ")]
        assert len(openings) == 1, name
        for source in block.sources:
            assert f"bench/results/{source}" in openings[0]


# (JSON file, the edit, the start of the row it moves, the cell the edit puts there): the row is
# named, not its other numbers, so a rerun of the benchmarks does not touch this list.
EDITS: list[tuple[str, Callable[[Any], None], str, str]] = [
    (
        "sharing.json",
        lambda d: _summary(d, "gpushare").update(offline_norm_mean=0.613),
        "| gpushare | ",
        "| 0.61 |",
    ),
    (
        "sharing-slo1.1-nogating.json",
        lambda d: _summary(d, "gpushare").update(within_7pct=17),
        "| gpushare without gating (`--no-gating`) | ",
        "| 17/39 |",
    ),
    (
        "sharing-slo2-nogating.json",
        lambda d: _summary(d, "gpushare").update(p99_overhead_worst=4.321),
        "| 2x | gpushare without gating | ",
        "| +432.1% |",
    ),
    (
        "sharing-slo1.5.json",
        lambda d: _summary(d, "mps").update(slo_attainment_mean=0.1234),
        "| 1.05x / 1.1x / 1.5x / 2x | mps | ",
        " / 12.34 / ",
    ),
    (
        "sharing.json",
        lambda d: d["scenarios"][1]["rows"][0].update(online_p50_ms=99.94),
        "| azure-bursty | gpushare | ",
        "| 99.9 |",
    ),
    (
        "sharing.json",
        # the worst of the 14 Tally-shaped pairs' service time under tally-like
        lambda d: next(
            r
            for sc in d["scenarios"]
            if sc["scenario"] == "pair-bert_2_fwd+bert_8_fb1"
            for r in sc["rows"]
            if r["policy"] == "tally-like"
        ).update(service_overhead=6.0),
        "| tally-like | ",
        "| 7.0x |",
    ),
    (
        "frontier_pairs.json",
        lambda d: d["policies"]["gpushare"]["1.5"].update(offline_norm_mean=0.917),
        "| **gpushare (gating + delay, trust 60 s)**: now | ",
        ", 0.92** |",
    ),
    (
        "frontier_pairs_gpubound.json",
        lambda d: d["policies"]["gpushare"]["1.1"].update(offline_norm_mean=0.777),
        "| **gpushare (gating + delay, trust 60 s)**: now | ",
        ", 0.78** |",
    ),
    (
        # Issue 33: the baselines against the hardware ranges are computed from the runs, so a
        # run's median moved into the range reads "inside" and one moved out says by how much.
        "sim_pairs.json",
        lambda d: next(
            c
            for r in d["runs"]
            if r["duration_s"] == 20
            for c in r["checks"]
            if (c["variant"], c["set"], c["baseline"], c["metric"])
            == ("gpu-bound", "14 Tally-shaped", "time-slicing", "latency")
        ).update(median_ratio=2.5, worst_ratio=2.6),
        "| gpu-bound | 14 Tally-shaped | time-slicing | 1.8-2.7x | ",
        "| 2.50x (2.6x) inside |",
    ),
    (
        "sim_pairs.json",
        lambda d: next(
            c
            for r in d["runs"]
            if r["duration_s"] == 40
            for c in r["checks"]
            if (c["variant"], c["set"], c["baseline"], c["metric"])
            == ("host-bound", "14 Tally-shaped", "mps", "service")
        ).update(median_ratio=30.0, off_by=2.5),
        "| host-bound | 14 Tally-shaped | mps | 1.3-12x | ",
        "| 30.00x (2.5x) x2.50 |",
    ),
    (
        "frontier.json",
        lambda d: d["policies"]["gpushare (no gating)"]["2"].update(slo_attainment_mean=0.9123),
        "| gpushare (no gating): before | ",
        "| 91.23 %, ",
    ),
]


@pytest.mark.parametrize(
    ("name", "edit", "row", "cell"), EDITS, ids=[f"{e[0]}:{i}" for i, e in enumerate(EDITS)]
)
def test_check_fails_when_a_json_number_changes(
    copy: tuple[Path, Path], name: str, edit: Callable[[Any], None], row: str, cell: str
) -> None:
    doc, results = copy
    before = doc.read_bytes()
    assert dt.check(doc, results) == []
    assert not any(line.startswith(row) and cell in line for line in before.decode().split("\n"))
    _edit_json(results, name, edit)

    diff = dt.check(doc, results)
    assert any(d.startswith("+" + row) and cell in d for d in diff), "\n".join(diff)
    assert dt.main(["--check", "--doc", str(doc), "--results", str(results)]) == 1
    assert doc.read_bytes() == before  # --check writes nothing

    # Without --check the block is rewritten, and only lines inside blocks change.
    assert dt.main(["--doc", str(doc), "--results", str(results)]) == 0
    assert dt.check(doc, results) == []
    old, new = before.decode().split("\n"), doc.read_text().split("\n")
    assert len(old) == len(new)
    changed = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    assert changed
    for i in changed:
        opening = max(j for j in range(i) if new[j].startswith(dt.OPEN))
        assert dt.END not in new[opening:i]


def test_check_catches_a_cell_rounded_by_hand(copy: tuple[Path, Path]) -> None:
    doc, results = copy
    text = doc.read_text()
    line = next(row for row in text.split("\n") if row.startswith("| 1.5x | **gpushare** |"))
    cells = line.split(" | ")
    cells[7] = f"{float(cells[7]) + 0.01:.2f}"  # the offline throughput, one step off
    by_hand = " | ".join(cells)
    doc.write_text(text.replace(line, by_hand))
    diff = dt.check(doc, results)
    assert "-" + by_hand in diff
    assert "+" + line in diff


def test_prose_outside_the_markers_is_neither_checked_nor_rewritten(
    copy: tuple[Path, Path],
) -> None:
    doc, results = copy
    text = doc.read_text().replace("(target >= 0.40)", "(target >= 0.41)")
    doc.write_text(text)
    assert dt.check(doc, results) == []
    assert dt.regenerate(text, results) == text


def test_a_baseline_that_moves_with_the_factor_is_refused(copy: tuple[Path, Path]) -> None:
    doc, results = copy
    _edit_json(results, "sharing-slo2.json", lambda d: _summary(d, "tgs").update(busy_mean=0.5))
    with pytest.raises(dt.DocError, match=r"tgs: busy_mean at 2x .* give it a row per factor"):
        dt.check(doc, results)


def _unmark(text: str, name: str) -> str:
    """``text`` with block ``name``'s two marker lines taken out (its table left as it is)."""
    lines = text.split("\n")
    i = next(i for i, line in enumerate(lines) if line.startswith(f"{dt.OPEN}{name} "))
    j = lines.index(dt.END, i)
    return "\n".join(lines[:i] + lines[i + 1 : j] + lines[j + 1 :])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace(f"{dt.OPEN}frontier-all ", f"{dt.OPEN}frontier-al1 "), "unknown"),
        (lambda t: _unmark(t, "sharing-pairs"), "no marker for block.*sharing-pairs"),
        (
            lambda t: t.replace(f"{dt.OPEN}sharing-pairs ", "<!-- was generated: sharing-pairs "),
            "line [0-9]+: <!-- end generated --> without an opening marker",
        ),
        (lambda t: t.replace(dt.END, "<!-- end -->", 1), "has no <!-- end generated -->"),
    ],
)
def test_broken_markers_are_refused(
    copy: tuple[Path, Path], edit: Callable[[str], str], message: str
) -> None:
    doc, results = copy
    doc.write_text(edit(doc.read_text()))
    before = doc.read_bytes()
    with pytest.raises(dt.DocError, match=message):
        dt.check(doc, results)
    assert dt.main(["--doc", str(doc), "--results", str(results)]) == 2
    assert doc.read_bytes() == before


def test_a_missing_json_is_named(copy: tuple[Path, Path]) -> None:
    doc, results = copy
    (results / "frontier.json").unlink()
    with pytest.raises(dt.DocError, match=r"frontier\.json: missing; rerun"):
        dt.check(doc, results)


def test_a_block_reads_only_the_json_its_marker_names(copy: tuple[Path, Path]) -> None:
    _, results = copy
    view = dt.Results(results).only(["frontier.json"])
    assert view("frontier.json")["policies"]
    with pytest.raises(dt.DocError, match="sharing.json: read by a block whose sources"):
        view("sharing.json")
