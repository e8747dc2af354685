"""Config inputs and reload: every bad value refused with one line; reload applies all or nothing.

``config check`` and reload share the loader: NaN and infinities in any number, a duration or size
too long for a float, an unknown policy. Reload also refuses a file no other user may change
(gpushare.trust) and a file that changes a key read only at start, naming those keys.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpushare import config
from gpushare.cli.app import app
from gpushare.control import registry as policies
from gpushare.daemon.core import Daemon
from gpushare.daemon.registry import Registry
from gpushare.model import ClientClass, SetOfflinePriority
from gpushare.node.signal_pauser import SignalPauser
from gpushare.roots import daemon as daemon_main
from tests.fakes.fake_gpu import FakeGpuBackend, fake_uuid
from tests.fakes.fake_mps import FakeMpsNode

runner = CliRunner()


def _float_keys() -> list[str]:
    """Every plain number key of every table (durations and sizes are parsed from text)."""
    keys = []
    tables = typing.get_type_hints(config.Config)
    for table in dataclasses.fields(config.Config):
        section = tables[table.name]
        if not dataclasses.is_dataclass(section):
            continue
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            if hints[f.name] is float and "kind" not in f.metadata:
                keys.append(f"{table.name}.{config.toml_key(f)}")
    return keys


FLOAT_KEYS = _float_keys()


def test_the_float_keys_include_those_the_issue_found() -> None:
    for key in ("control.comfort_ratio", "control.duty_increase_step", "gate.max_busy",
                "mps.default_active_thread_pct"):  # fmt: skip
        assert key in FLOAT_KEYS
    assert len(FLOAT_KEYS) >= 15


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "+nan"])
def test_no_float_key_takes_nan_or_an_infinity(key: str, value: str) -> None:
    section, name = key.split(".")
    with pytest.raises(config.ConfigError) as err:
        config.loads(f"[{section}]\n{name} = {value}\n", "g.toml")
    assert err.value.key == key
    assert str(err.value).count("\n") == 0


@pytest.mark.parametrize(
    "text",
    [
        '[[adopt]]\nname = "a"\nmarker = true\nsm_pct = nan\n',
        '[gpus."0"]\noffline_sm_pct_max = nan\n',
    ],
)
def test_nan_is_refused_in_rules_and_per_gpu_tables_too(text: str) -> None:
    with pytest.raises(config.ConfigError, match="finite"):
        config.loads(text)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        # A long enough digit string is an infinite float (durations) or no float at all (sizes).
        ('[daemon]\ncancel_grace = "' + "9" * 400 + 's"\n', "daemon.cancel_grace"),
        ('[control]\nonline_memory_reserve = "' + "9" * 400 + 'G"\n',
         "control.online_memory_reserve"),
        ("[mps]\ndefault_active_thread_pct = 5e-324\n", "mps.default_active_thread_pct"),
        ('[control]\npolicy = "bogus"\n', "control.policy"),
    ],
)  # fmt: skip
def test_values_that_are_no_setting_are_refused_naming_the_key(text: str, key: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.loads(text, "g.toml")
    assert err.value.key == key


def test_the_config_knows_every_policy_the_daemon_can_build() -> None:
    assert config.POLICY_NAMES == policies.POLICY_NAMES


def test_config_check_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    f = tmp_path / "g.toml"
    f.write_text('[control]\npolicy = "bogus"\ncomfort_ratio = nan\n')
    result = runner.invoke(app, ["config", "check", str(f)])
    assert result.exit_code == 2
    assert (
        result.stderr == f"error: {f}: control.comfort_ratio: expected a finite number, got nan\n"
    )
    f.write_text('[control]\npolicy = "bogus"\n')
    result = runner.invoke(app, ["config", "check", str(f)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {f}: control.policy: unknown policy 'bogus'; valid")


# Reload ---------------------------------------------------------------------------------------


def _text(base: Path, extra: str = "", *, socket_mode: str = "0666") -> str:
    return f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
[daemon]
socket_mode = "{socket_mode}"
cancel_grace = "2s"
[probe]
enabled = false
[metrics]
enabled = false
{extra}"""


@pytest.fixture
def daemon(trusted_tmp: Path, tmp_path: Path) -> Iterator[Daemon]:
    path = trusted_tmp / "gpushare.toml"
    path.write_text(_text(tmp_path))
    cfg = config.load(path)
    d = Daemon(
        cfg, registry=Registry.open(cfg.paths.resolved("database")), gpu=FakeGpuBackend(),
        mps=FakeMpsNode(pipe_root=tmp_path / "mps"), pauser=SignalPauser(), notify=lambda *f: True,
        config_path=path,
    )  # fmt: skip
    try:
        yield d
    finally:
        d.registry.close()


def _last_event(d: Daemon) -> tuple[str, str]:
    e = d.registry.events(0, 1000)[-1]
    return e.kind, e.message


def test_reload_applies_the_keys_it_can(daemon: Daemon, tmp_path: Path) -> None:
    assert daemon.config_path is not None
    daemon.config_path.write_text(
        _text(tmp_path).replace('"2s"', '"1s"')
        + '[mps]\nmax_clients = 8\n[gpus."0"]\noffline_sm_pct_max = 50\n'
    )
    assert daemon.reload() is True
    assert daemon.config.daemon.cancel_grace_s == 1.0
    assert daemon.config.mps.max_clients == 8
    assert daemon.config.gpu_override(0, "GPU-x").offline_sm_pct_max == 50.0
    assert _last_event(daemon)[0] == "config_reloaded"


def test_a_reload_that_changes_the_policy_takes_back_the_priority_the_old_one_chose(
    daemon: Daemon, tmp_path: Path
) -> None:
    # The new policy starts from its initial state (the configured priority): a priority of 0 the
    # old one chose must not outlive it, or no one would ever set it back (here: the rule off).
    gpu = fake_uuid(0)
    daemon.loop.apply(SetOfflinePriority(gpu, 0, "room"), 0.0)
    assert daemon.state.priority(ClientClass.OFFLINE, (gpu,)) == 0
    assert daemon.config_path is not None
    daemon.config_path.write_text(_text(tmp_path, "[control]\nequal_priority_below = 0.0\n"))
    assert daemon.reload() is True
    assert daemon.state.priority(ClientClass.OFFLINE, (gpu,)) == 1


@pytest.mark.parametrize(
    ("change", "keys"),
    [
        (lambda t: t.replace('"0666"', '"0600"'), "daemon.socket_mode"),
        (lambda t: t.replace('cancel_grace = "2s"', 'cancel_grace = "2s"\nmax_request = "64K"'),
         "daemon.max_request"),
        (lambda t: t.replace("/run\"", "/run2\""),
         "paths.latency_socket, paths.mps_log_dir, paths.mps_pipe_dir, paths.runtime_dir, "
         "paths.socket"),
        (lambda t: t.replace('"0666"', '"0600"').replace('"2s"', '"1s"'), "daemon.socket_mode"),
        (lambda t: t + '[gpus."0"]\nshared = false\n', "gpus.0.shared"),
        (lambda t: t + "[mps]\nmax_clients = 8\nhealth_period = \"1s\"\n", "mps.health_period"),
    ],
)  # fmt: skip
def test_reload_refuses_a_file_that_changes_a_key_read_only_at_start(
    daemon: Daemon, tmp_path: Path, change, keys: str
) -> None:
    before = daemon.config
    assert daemon.config_path is not None
    daemon.config_path.write_text(change(_text(tmp_path)))
    assert daemon.reload() is False
    assert daemon.config is before  # nothing applied, the live keys neither
    kind, message = _last_event(daemon)
    assert kind == "config_reload_failed"
    assert message == (
        f"config not reloaded, the old one stays in force: {daemon.config_path}: these keys need "
        f"a restart of gpushare: {keys} (restore them and reload, or restart: workloads keep "
        "running)"
    )


def test_reload_refuses_nan_and_an_unknown_policy(daemon: Daemon, tmp_path: Path) -> None:
    assert daemon.config_path is not None
    for extra, key in (("[gate]\nmax_busy = nan\n", "gate.max_busy"),
                       ('[control]\npolicy = "bogus"\n', "control.policy")):  # fmt: skip
        daemon.config_path.write_text(_text(tmp_path, extra))
        assert daemon.reload() is False
        kind, message = _last_event(daemon)
        assert kind == "config_reload_failed"
        assert f"{daemon.config_path}: {key}: " in message
    assert daemon.config.gate.max_busy == 0.9


def test_reload_refuses_a_config_another_user_could_change(daemon: Daemon, tmp_path: Path) -> None:
    path = daemon.config_path
    assert path is not None
    path.write_text(_text(tmp_path).replace('"2s"', '"1s"'))
    os.chown(path, 65534, 65534)
    assert daemon.reload() is False
    kind, message = _last_event(daemon)
    assert kind == "config_reload_failed"
    assert f"the config file {path} is not trusted: {path} is owned by uid 65534" in message
    assert daemon.config.daemon.cancel_grace_s == 2.0


def test_the_daemon_does_not_start_on_a_config_another_user_could_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gpushare.toml"
    path.write_text(_text(tmp_path))
    assert daemon_main.main(path, simulate=1) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpushare: the config file {path} is not trusted: /tmp is a shared")
    assert err.count("\n") == 1
    assert not (tmp_path / "run").exists()  # nothing was started
