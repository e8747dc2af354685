"""An LLM server's token SLOs outside `submit` (issue 33): `[[adopt]]` rules, the adoption markers
and `gpushare env`, which writes the markers adoption reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpushare import config
from gpushare.cli.app import app
from gpushare.config import ConfigError
from gpushare.control.adoption import Rule, decide, read_marker
from gpushare.model import ClientClass, ProcessFacts

GPU = "GPU-8a2f1c3e-1111-2222-3333-444455556666"
runner = CliRunner()


def _facts(environ: dict[str, str]) -> ProcessFacts:
    return ProcessFacts(
        pid=100, ppid=1, uid=1000, user="alice", name="vllm", start_time=1.0,
        cgroup="/system.slice/vllm.service", unit="vllm.service", environ=environ,
        gpu_uuids=(GPU,),
    )  # fmt: skip


def test_adopt_rules_take_token_slos_and_refuse_them_offline() -> None:
    cfg = config.loads(
        """
        [[adopt]]
        name = "vllm"
        unit = "vllm*.service"
        class = "online"
        slo_ttft_p99 = "500ms"
        slo_tpot_p99 = "50ms"
        """
    )
    (rule,) = cfg.adopt
    assert (rule.slo_ttft_p99_s, rule.slo_tpot_p99_s) == (0.5, 0.05)
    assert config.loads(config.to_toml(cfg)) == cfg
    d = decide([Rule(rule, 0, "/etc/gpushare/gpushare.toml")], _facts({}))
    assert d.adopt and (d.slo_ttft_p99_s, d.slo_tpot_p99_s) == (0.5, 0.05)
    for text, key in (
        ('[[adopt]]\nunit = "x"\nclass = "offline"\nslo_tpot_p99 = "50ms"', "slo_tpot_p99"),
        ('[[adopt]]\nunit = "x"\nclass = "online"\nslo_ttft_p99 = "soon"', "slo_ttft_p99"),
        ('[[adopt]]\nunit = "x"\nclass = "online"\nslo_ttft_p99 = "0s"', "slo_ttft_p99"),
    ):
        with pytest.raises(ConfigError) as exc:
            config.loads(text)
        assert key in str(exc.value) and "\n" not in str(exc.value)


def test_markers_carry_token_slos_and_a_bad_one_says_why() -> None:
    env = {"GPUSHARE_CLASS": "online", "GPUSHARE_SLO_TTFT_P99": "500ms"}
    m = read_marker(env)
    assert m is not None and m.error is None
    assert (m.slo_ttft_p99_s, m.slo_tpot_p99_s) == (0.5, None)
    d = decide([Rule(config.MARKER_RULE, 0, "/etc/gpushare/gpushare.toml")], _facts(env))
    assert d.adopt and d.slo_ttft_p99_s == 0.5 and d.cls is ClientClass.ONLINE
    bad = read_marker({"GPUSHARE_CLASS": "offline", "GPUSHARE_SLO_TPOT_P99": "50ms"})
    assert bad is not None and bad.error is not None
    assert "GPUSHARE_SLO_TPOT_P99" in bad.error and "--online" in bad.error


def _env(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'[paths]\nruntime_dir = "{tmp_path}/run"\n')
    result = runner.invoke(
        app, ["env", *args, "--gpu", GPU, "--config", str(cfg),
              "--socket", str(tmp_path / "none.sock")],
    )  # fmt: skip
    return result.exit_code, result.stdout, result.stderr


def test_gpushare_env_writes_the_markers_adoption_reads_back(tmp_path: Path) -> None:
    code, out, err = _env(
        tmp_path, "--online", "--slo-ttft-p99", "500ms", "--slo-tpot-p99", "50ms", "--json"
    )
    assert code == 0, err
    env = json.loads(out)["env"]
    assert (env["GPUSHARE_SLO_TTFT_P99"], env["GPUSHARE_SLO_TPOT_P99"]) == ("500ms", "50ms")
    assert "GPUSHARE_SLO_P99" not in env
    m = read_marker(env)
    assert m is not None and (m.slo_ttft_p99_s, m.slo_tpot_p99_s) == (0.5, 0.05)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--online", "--slo-ttft-p99", "soon"], "--slo-ttft-p99"),
        (["--offline", "--slo-tpot-p99", "50ms"], "applies to --online clients only"),
    ],
)
def test_gpushare_env_refuses_a_bad_token_slo_in_one_line(
    tmp_path: Path, args: list[str], says: str
) -> None:
    code, out, err = _env(tmp_path, *args)
    assert code != 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], err
