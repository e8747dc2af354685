"""``gpushare sim``: the command runs the registry's policies and writes its table, JSON and plots."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from gpushare.cli.app import app
from gpushare.control.registry import POLICY_NAMES
from gpushare.sim import report

SCENARIO = """
[scenario]
name = "cli-pair"
duration = "3s"
warmup = "0.5s"
[[online]]
name = "inf"
profile = "orion-v100-kernels/resnet50_4_fwd.csv"
load = 0.5
[[offline]]
name = "train"
profile = "orion-v100-kernels/mobilenetv2_32_fb1.csv"
submit = "0.2s"
"""


def test_sim_runs_policies_and_writes_outputs(tmp_path: Path) -> None:
    sc = tmp_path / "s.toml"
    sc.write_text(SCENARIO)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["sim", str(sc), "--policy", "gpushare", "--policy", "mps", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "p99 ovh" in result.output
    assert "x real time overall" in result.output
    doc = json.loads((out / "cli-pair.json").read_text())
    assert [r["policy"] for r in doc["rows"]] == ["gpushare", "mps"]
    assert doc["alone"]["online"][0]["requests"] > 100
    gpushare, mps = doc["rows"]
    # Plain MPS slows the server (its host time between kernels hides part of the wait, W3).
    assert mps["p99_overhead"] > max(0.1, gpushare["p99_overhead"])
    for suffix in ("latency-cdf", "offline-throughput", "duty"):
        assert (out / f"cli-pair-{suffix}.png").stat().st_size > 1000


def test_every_registered_policy_runs_and_rows_are_consistent(tmp_path: Path) -> None:
    from gpushare.cli import sim_run

    sc = tmp_path / "s.toml"
    sc.write_text(SCENARIO.replace('"3s"', '"2s"'))
    (result,) = sim_run.run_files([sc], None, progress=False)
    rows = report.summarise(result)
    assert [r.policy for r in rows] == list(POLICY_NAMES)
    for r in rows:
        assert 0.0 <= r.busy_fraction <= 1.0
        assert 0.0 <= r.sm_active_fraction <= r.busy_fraction + 1e-9
        assert r.system_throughput >= (r.offline_norm or 0.0)
    by = {r.policy: r for r in rows}
    assert (by["exclusive"].offline_norm or 0.0) < 0.05


def test_bad_inputs_exit_2_with_the_reason(tmp_path: Path) -> None:
    sc = tmp_path / "s.toml"
    sc.write_text(SCENARIO)
    runner = CliRunner()
    res = runner.invoke(app, ["sim", str(sc), "--policy", "nope", "--out", str(tmp_path)])
    assert res.exit_code == 2
    assert "unknown policy 'nope'" in res.output
    bad = tmp_path / "bad.toml"
    bad.write_text(SCENARIO.replace("load = 0.5", "load = 'high'"))
    res = runner.invoke(app, ["sim", str(bad), "--out", str(tmp_path)])
    assert res.exit_code == 2
    assert "online[0].load" in res.output
    assert not (tmp_path / "cli-pair.json").exists()


def test_a_bad_scenario_among_good_ones_runs_none_of_them(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(SCENARIO)
    overloaded = tmp_path / "overloaded.toml"
    overloaded.write_text(SCENARIO.replace("load = 0.5", "load = 1.2"))
    missing = tmp_path / "missing.toml"
    out = tmp_path / "out"
    runner = CliRunner()
    for bad in (overloaded, missing):
        res = runner.invoke(app, ["sim", str(good), str(bad), "--out", str(out)])
        assert res.exit_code == 2, res.output
        assert str(bad) in res.output
        assert not out.exists()  # the good scenario, named first, did not run either
    res = runner.invoke(app, ["sim", str(good), str(overloaded), "--out", str(out)])
    assert "online[0].load: must be below 1" in res.output


def test_slo_factor_overrides_the_scenarios_slo(tmp_path: Path) -> None:
    from gpushare.cli import sim_run

    sc = tmp_path / "s.toml"
    sc.write_text(SCENARIO.replace('"3s"', '"1s"'))
    (default,) = sim_run.run_files([sc], ["exclusive"], progress=False)
    (loose,) = sim_run.run_files([sc], ["exclusive"], progress=False, slo_factor=2.0)
    assert default.alone is not None and loose.alone is not None
    alone_p99 = loose.alone.online[0].p99_ms
    assert default.slo_ms["inf"] == 1.1 * default.alone.online[0].p99_ms  # the scenario default
    assert loose.slo_ms["inf"] == 2.0 * alone_p99
    assert loose.runs[0].online[0].slo_p99_ms == 2.0 * alone_p99
    # An explicit SLO in ms is the user's contract: the factor does not replace it.
    fixed = tmp_path / "fixed.toml"
    fixed.write_text(
        SCENARIO.replace('"3s"', '"1s"').replace("load = 0.5", "load = 0.5\nslo_p99_ms = 50.0")
    )
    (kept,) = sim_run.run_files([fixed], ["exclusive"], progress=False, slo_factor=2.0)
    assert kept.slo_ms["inf"] == 50.0


def test_the_cli_runs_a_scenario_through_the_runner_and_its_slo_rule(tmp_path: Path) -> None:
    # One way to run a scenario: what `gpushare sim` reports is runner.run_scenario's result.
    from gpushare.cli import sim_run
    from gpushare.sim import runner, scenario

    sc = tmp_path / "s.toml"
    sc.write_text(SCENARIO.replace('"3s"', '"2s"'))
    (via_cli,) = sim_run.run_files([sc], ["exclusive"], progress=False)
    loaded = scenario.load(sc)
    seen: list[str] = []
    direct = runner.run_scenario(
        loaded,
        sim_run.make_policies(["exclusive"], loaded.config.control),
        on_run=lambda label, run: seen.append(f"{label} {run.policy}"),
    )
    assert seen == ["alone alone", "exclusive exclusive"]
    assert via_cli.slo_ms == direct.slo_ms
    (spec,) = loaded.online
    assert direct.alone is not None
    assert direct.slo_ms[spec.name] == runner.slo_of(spec, direct.alone.online[0].p99_ms)
    assert [r.online[0].p99_ms for r in via_cli.runs] == [r.online[0].p99_ms for r in direct.runs]
