"""Scenario files: every shipped one parses; bad ones fail with errors naming file, key and fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushare.daemon.launcher import choose_queue
from gpushare.model import DEFAULT_OFFLINE_QUEUE, DEFAULT_QUEUE_MODE
from gpushare.sim import scenario

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "gpushare" / "scenarios").rglob("*.toml"))

GOOD = """
[scenario]
name = "ok"
duration = "10s"
[[online]]
name = "inf"
profile = "orion-v100-kernels/resnet50_4_fwd.csv"
[[offline]]
name = "train"
profile = "orion-v100-kernels/resnet50_32_fb1.csv"
"""


def test_the_shipped_set_is_complete() -> None:
    names = {p.name for p in SHIPPED}
    assert len([p for p in SHIPPED if p.parent.name == "pairs"]) == 35  # 5 fwd x 7 fb1
    assert {"azure-bursty.toml", "genai-idle.toml", "alibaba-node-mix.toml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_scenario_parses(path: Path) -> None:
    sc = scenario.load(path)
    assert sc.duration_s > sc.warmup_s
    assert sc.online or sc.offline
    assert all(0 <= s.gpu < sc.gpu.count for s in (*sc.online, *sc.offline))


def test_good_scenario_has_defaults_and_config_overrides() -> None:
    sc = scenario.loads(GOOD + '\n[control]\nperiod = "50ms"\n', "x.toml")
    assert sc.online[0].load == 0.5
    assert sc.config.control.period_s == pytest.approx(0.05)
    assert sc.gpu.sm_count == 80


def test_an_offline_job_without_a_queue_gets_what_a_submit_without_queue_gets() -> None:
    # One default for both (issue 30), auto since issue 32: a scenario's job without ``queue`` is
    # recorded as a submit without --queue is.
    (job,) = scenario.loads(GOOD).offline
    assert job.queue == DEFAULT_OFFLINE_QUEUE == "auto"
    (asked,) = scenario.loads(GOOD + 'queue = "deep"\n').offline
    assert asked.queue == "deep"
    # A record naming no queue (a job submitted before issue 32) runs as it was launched: deep.
    assert choose_queue(None, gating_on=True) == (DEFAULT_QUEUE_MODE, "default queue (deep)")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_scenarios_say_their_queue(path: Path) -> None:
    # They were written when the simulator's default was auto; saying so keeps their runs.
    assert all(job.queue == "auto" for job in scenario.load(path).offline)


@pytest.mark.parametrize(
    ("mutation", "key", "words"),
    [
        (("[scenario]", "[scenario]\nbogus = 1"), "scenario.bogus", "unknown key"),
        (('duration = "10s"', 'duration = "ten"'), "scenario.duration", "duration"),
        (('duration = "10s"', 'duration = "10s"\nwarmup = "20s"'), "scenario.warmup", "shorter"),
        (('name = "inf"', 'name = "inf"\nload = 0.5\nrps = 3.0'), "online[0].rps", "either"),
        (('name = "inf"', 'name = "inf"\narrivals = "azure"'), "online[0].trace", "trace"),
        (('name = "inf"', 'name = "inf"\narrivals = "gamma"'), "online[0].arrivals", "poisson"),
        (('name = "inf"', 'name = "inf"\ngpu = 3'), "online[0].gpu", "integer in [0, 0]"),
        (('name = "train"', 'name = "train"\nmem = "lots"'), "offline[0].mem", "size"),
        (
            ("resnet50_32_fb1.csv", "nope_fb1.csv"),
            "offline[0].profile",
            "no such data file",
        ),
        (('name = "train"', 'name = "inf"'), "name", "unique"),
        (("[[online]]", "[gpu]\ncount = 0\n[[online]]"), "gpu.count", "a value >= 1 and <= 64"),
        (('name = "train"\n', ""), "offline[0].name", "missing; give a string"),
        (("[[online]]", '[control]\nperiod = "fast"\n[[online]]'), "control.period", ""),
        (("[[online]]", "[control]\nnot_a_key = 1\n[[online]]"), "control.not_a_key", "unknown"),
        (('name = "inf"', 'name = "inf"\nburst = ["1s", "2s"]'), "online[0].burst", "expected"),
        (('name = "inf"', 'name = "inf"\nburst = ["1s", "0s", 3]'), "online[0].burst", "positive"),
        (
            ('name = "inf"', 'name = "inf"\nburst = ["soon", "1s", 3]'),
            "online[0].burst",
            "expected",
        ),
        (('name = "inf"', 'name = "inf"\nload = -0.5'), "online[0].load", "above 0"),
        (('name = "inf"', 'name = "inf"\nload = 0'), "online[0].load", "above 0"),
        (('name = "inf"', 'name = "inf"\nload = 1'), "online[0].load", "below 1"),
        (('name = "inf"', 'name = "inf"\nload = 2.5'), "online[0].load", "below 1"),
        (('name = "inf"', 'name = "inf"\nload = "half"'), "online[0].load", "number"),
        (('name = "inf"', 'name = "inf"\nrps = 400.0'), "online[0].rps", "load of"),
        # 120/s of 6.5 ms of kernels is a load of 0.78, but each pass takes 9.9 ms with its
        # host cost (W3): 1.18, a queue that never drains.
        (('name = "inf"', 'name = "inf"\nrps = 120.0'), "online[0].rps", "load of 1.18"),
        (
            ("[[online]]", '[gpu]\nhost_per_kernel = "-5us"\n[[online]]'),
            "gpu.host_per_kernel",
            "duration",
        ),
        (("resnet50_4_fwd.csv", "nope_fwd.csv"), "online[0].profile", "no such data file"),
        (("orion-v100-kernels/resnet50_4", "nowhere/resnet50_4"), "online[0].profile", "no such"),
        (
            ('name = "inf"', 'name = "inf"\narrivals = "azure"\ntrace = "azure-llm-2023/x.csv"'),
            "online[0].trace",
            "no such data file",
        ),
    ],
)
def test_bad_scenario_names_the_key(mutation: tuple[str, str], key: str, words: str) -> None:
    text = GOOD.replace(mutation[0], mutation[1], 1)
    with pytest.raises(scenario.ScenarioError) as info:
        scenario.loads(text, "bad.toml")
    err = info.value
    assert err.key == key
    assert str(err).startswith(f"bad.toml: {key}: ")
    assert words in err.reason


def test_a_scenario_and_the_config_read_a_bad_value_alike() -> None:
    # One machinery (gpushare.tomlschema): the same mistake, the same words, in both files.
    from gpushare import config

    cases = [
        ('[gpu]\nmem_total = "lots"\n', '[control]\nonline_memory_reserve = "lots"\n'),
        ("[gpu]\ncolour = 1\n", "[control]\ncolour = 1\n"),
        ('[gpu]\nslice = "soon"\n', '[control]\nperiod = "soon"\n'),
        ("[gpu]\nbw_beta = true\n", "[control]\nhard_ratio = true\n"),
    ]
    for in_scenario, in_config in cases:
        with pytest.raises(scenario.ScenarioError) as sc_err:
            scenario.loads(GOOD + in_scenario, "s.toml")
        with pytest.raises(config.ConfigError) as cfg_err:
            config.loads(in_config, "c.toml")
        sc_words, cfg_words = sc_err.value.reason, cfg_err.value.reason
        assert sc_words.split(";")[0] == cfg_words.split(";")[0], (sc_words, cfg_words)


def test_burst_parses_and_raises_the_rate() -> None:
    from gpushare.sim.arrivals import arrivals_for

    text = GOOD.replace('name = "inf"', 'name = "inf"\nrps = 10.0\nburst = ["2s", "1s", 5]')
    text = text.replace("[[offline]]", '[[offline]]\nsubmit = "60s"')
    sc = scenario.loads(text.replace('duration = "10s"', 'duration = "4s"'), "x.toml")
    assert sc.online[0].burst == (2.0, 1.0, 5.0)
    arrivals = list(arrivals_for(sc.online[0], 0.0065, 1, 4.0))
    in_burst = sum(1 for t in arrivals if 2.0 <= t < 3.0)
    before = sum(1 for t in arrivals if 0.0 <= t < 2.0) / 2
    assert in_burst > 2.5 * before


def test_not_toml_and_missing_file() -> None:
    with pytest.raises(scenario.ScenarioError, match="not valid TOML"):
        scenario.loads("[scenario\n", "x.toml")
    with pytest.raises(scenario.ScenarioError, match="no such file, and no shipped scenario"):
        scenario.load("/nonexistent/x.toml")
    with pytest.raises(scenario.ScenarioError, match=r"missing table \[scenario\]"):
        scenario.loads("[[online]]\nname='a'\n", "x.toml")
    with pytest.raises(scenario.ScenarioError, match="at least one"):
        scenario.loads("[scenario]\nname='a'\n", "x.toml")


def test_physics_keys_parse() -> None:
    text = GOOD.replace(
        "[[online]]", '[gpu]\nswitch = "100us"\nwave_scale = 2.0\nlaunch_gap = "5us"\n[[online]]'
    )
    text = text.replace('name = "train"', 'name = "train"\nlaunch_blocking = true')
    sc = scenario.loads(text, "x.toml")
    assert sc.gpu.switch_s == pytest.approx(100e-6)
    assert sc.gpu.wave_scale == 2.0
    assert sc.gpu.launch_gap_s == pytest.approx(5e-6)
    no_host = scenario.loads(
        GOOD.replace("[[online]]", '[gpu]\nhost_per_kernel = "0s"\n[[online]]', 1), "x.toml"
    )
    assert no_host.gpu.host_per_kernel_s == 0.0
    # Without the host cost 120/s of ResNet-50 b4 passes is a load the server can carry.
    assert (
        scenario.loads(
            GOOD.replace('name = "inf"', 'name = "inf"\nrps = 120.0', 1).replace(
                "[[online]]", '[gpu]\nhost_per_kernel = "0s"\n[[online]]', 1
            ),
            "x.toml",
        )
        .online[0]
        .rps
        == 120.0
    )
    assert sc.offline[0].launch_blocking and not sc.online[0].launch_blocking
    with pytest.raises(scenario.ScenarioError, match=r"gpu.wave_scale"):
        scenario.loads(GOOD.replace("[[online]]", "[gpu]\nwave_scale = 0\n[[online]]", 1), "x.toml")


LONG = sorted((REPO / "gpushare" / "scenarios" / "long").glob("*.toml"))
# What a 1-hour variant may change of its source (issue 32), beside name and duration.
_LONG_CHANGES = {
    "azure-bursty-1h.toml": {"trace_start", "trace_speedup"},
    "genai-idle-1h.toml": {"bin"},
}


def _source(long: Path) -> Path:
    stem = long.name.removesuffix("-1h.toml")
    root = REPO / "gpushare" / "scenarios"
    return (
        root / f"{stem}.toml"
        if (root / f"{stem}.toml").exists()
        else root / "pairs" / f"{stem}.toml"
    )


def test_the_long_set_is_seven_one_hour_variants() -> None:
    assert len(LONG) == 7
    assert len([p for p in LONG if "+" in p.name]) == 4
    for p in LONG:
        assert scenario.load(p).duration_s == 3600.0


@pytest.mark.parametrize("path", LONG, ids=lambda p: p.name)
def test_a_long_variant_differs_from_its_source_only_where_it_says(path: Path) -> None:
    import tomllib

    long, src = tomllib.loads(path.read_text()), tomllib.loads(_source(path).read_text())
    assert long["scenario"]["name"] == src["scenario"]["name"] + "-1h"
    for t in (long["scenario"], src["scenario"]):
        del t["name"], t["duration"]
    allowed = _LONG_CHANGES.get(path.name, set())
    for spec in (*long.get("online", ()), *src.get("online", ())):
        for key in allowed:
            spec.pop(key, None)
    assert long == src


GPU_BOUND = sorted((REPO / "gpushare" / "scenarios" / "gpubound").glob("*.toml"))


def test_every_pair_has_a_gpu_bound_variant() -> None:
    pairs = sorted((REPO / "gpushare" / "scenarios" / "pairs").glob("*.toml"))
    assert [p.name for p in GPU_BOUND] == [p.name for p in pairs]


@pytest.mark.parametrize("path", GPU_BOUND, ids=lambda p: p.name)
def test_a_gpu_bound_variant_differs_from_its_pair_only_in_the_host_cost(path: Path) -> None:
    # Issue 33 item 4: the same pair with the server's CPU at 5 us per kernel (a CUDA-graph or
    # TensorRT server) instead of eager PyTorch's 56.2 us.
    import tomllib

    variant = tomllib.loads(path.read_text())
    pair = tomllib.loads((REPO / "gpushare" / "scenarios" / "pairs" / path.name).read_text())
    assert variant.pop("gpu") == {"host_per_kernel": "5us"}
    assert variant["scenario"].pop("name") == pair["scenario"].pop("name").replace(
        "pair-", "pair-gpubound-", 1
    )
    assert variant == pair
    assert scenario.load(path).gpu.host_per_kernel_s == pytest.approx(5e-6)
