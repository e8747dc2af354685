"""Issue 32: a restart costs a simulated job the work since its last checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpushare.sim import scenario as sc_mod
from gpushare.sim.node import SimNode

PAIR = (
    Path(__file__).resolve().parents[2]
    / "gpushare"
    / "scenarios"
    / "pairs"
    / "bert_2_fwd+resnet50_32_fb1.toml"
)


def _ran(on_signal: bool, interval_s: float | None) -> tuple[SimNode, list[float], int]:
    sc = sc_mod.load(PAIR)
    off = tuple(
        dataclasses.replace(o, checkpoint_on_signal=on_signal, checkpoint_interval_s=interval_s)
        for o in sc.offline
    )
    node = SimNode(dataclasses.replace(sc, offline=off), with_online=False)
    (trainer,) = node.offline
    node.start()
    trainer.start(node.loop.now)
    node.checkpoints.started(trainer, node.loop.now)
    node.loop.run_until(3.25)
    before = list(trainer.iterations)
    lost = node.checkpoints.signalled(trainer, node.loop.now)
    return node, before, lost


def test_a_job_that_checkpoints_on_the_signal_loses_nothing() -> None:
    node, before, lost = _ran(True, None)
    assert lost == 0 and node.offline[0].iterations == before


def test_a_job_loses_the_iterations_since_its_last_periodic_checkpoint() -> None:
    node, before, lost = _ran(False, 1.0)
    kept = node.offline[0].iterations
    assert len(before) > 10
    assert kept == [t for t in before if t <= 3.0]
    assert lost == len(before) - len(kept) > 0
    assert node.checkpoints.lost == {node.offline[0].cid: lost}


def test_without_any_checkpoint_the_whole_run_is_lost() -> None:
    node, before, lost = _ran(False, None)
    assert node.offline[0].iterations == [] and lost == len(before) > 0


def test_the_restart_costs_a_minute_by_default_and_the_keys_are_checked(tmp_path: Path) -> None:
    assert sc_mod.GpuSpec().restart_s == 60.0
    text = PAIR.read_text().replace(
        "restartable = true", 'restartable = true\ncheckpoint_interval = "-1s"'
    )
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(sc_mod.ScenarioError, match="checkpoint_interval"):
        sc_mod.load(bad)
    good = tmp_path / "good.toml"
    good.write_text(
        PAIR.read_text().replace(
            "restartable = true",
            'restartable = true\ncheckpoint_interval = "10m"\ncheckpoint_on_signal = false\n'
            'restart_cost = "90s"',
        )
    )
    (o,) = sc_mod.load(good).offline
    assert o.checkpoint_interval_s == 600.0 and not o.checkpoint_on_signal
    assert o.restart_cost_s == 90.0  # submit --restart-cost, as the sim's daemon is told
