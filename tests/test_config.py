"""Config loading: every valid form, and every kind of bad input with a precise error."""

import dataclasses
from pathlib import Path

import pytest

from gpushare import config, shipped
from gpushare.config import Config, ConfigError

SHIPPED = shipped.path(shipped.CONFIG)


def test_shipped_file_loads_to_exactly_the_defaults():
    assert config.load(SHIPPED) == Config()


def _keys(obj: object, prefix: str = "") -> set[str]:
    out = set()
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        key = prefix + config.toml_key(f)
        if dataclasses.is_dataclass(value):
            out |= _keys(value, key + ".")
        elif f.name not in ("gpus", "adopt"):
            out.add(key)
    return out


def test_shipped_file_documents_every_key():
    text = SHIPPED.read_text()
    nested = {"gpus." + k for k in _keys(config.GpuOverride())}
    nested |= {"adopt." + k for k in _keys(config.AdoptRule())}
    for key in _keys(Config()) | nested:
        leaf = key.rsplit(".", 1)[-1]
        assert f"\n{leaf} =" in text or f"\n# {leaf} =" in text, f"{key} is not documented"


def test_empty_file_is_the_defaults():
    assert config.loads("") == Config()


def test_round_trip_through_rendered_toml():
    cfg = config.loads(
        """
        [paths]
        runtime_dir = "/tmp/gs/run"
        [control]
        period = "250ms"
        online_memory_reserve = "6G"
        [gpus."GPU-5d1a3c52-0a1e"]
        shared = false
        online_memory_reserve = "8G"
        [gpus."1"]
        offline_sm_pct_max = 40
        """
    )
    assert config.loads(config.to_toml(cfg)) == cfg


def test_sizes_and_durations_in_every_spelling():
    cfg = config.loads(
        """
        [control]
        period = 0.5
        online_memory_reserve = 1073741824
        share_min_interval = "2m"
        [probe]
        period = "20ms"
        [daemon]
        max_request = "64K"
        """
    )
    assert cfg.control.period_s == 0.5
    assert cfg.control.online_memory_reserve_bytes == 1 << 30
    assert cfg.control.share_min_interval_s == 120.0
    assert cfg.probe.period_s == pytest.approx(0.02)
    assert cfg.daemon.max_request_bytes == 64 << 10


def test_derived_paths_follow_runtime_and_state_dirs():
    cfg = config.loads('[paths]\nruntime_dir = "/x/run"\nstate_dir = "/x/state"\n')
    assert cfg.paths.socket == Path("/x/run/gpushare.sock")
    assert cfg.paths.mps_pipe_dir == Path("/x/run/mps")
    assert cfg.paths.database == Path("/x/state/gpushare.db")
    explicit = config.loads('[paths]\nruntime_dir = "/x/run"\nsocket = "/elsewhere/s.sock"\n')
    assert explicit.paths.socket == Path("/elsewhere/s.sock")


def test_gpu_override_lookup_prefers_uuid():
    cfg = config.loads(
        '[gpus."0"]\noffline_sm_pct_max = 30\n[gpus."GPU-abc"]\noffline_sm_pct_max = 60\n'
    )
    assert cfg.gpu_override(0, "GPU-abc").offline_sm_pct_max == 60
    assert cfg.gpu_override(0, "GPU-other").offline_sm_pct_max == 30
    assert cfg.gpu_override(3, "GPU-none") == config.GpuOverride()


def test_for_gpu_resolves_an_entry_over_the_node_wide_settings():
    cfg = config.loads(
        '[control]\nonline_memory_reserve = "2GiB"\noffline_sm_pct_max = 80\n'
        "[mps]\nmax_clients = 20\n"
        '[gpus."1"]\nshared = false\nmax_clients = 4\n'
        '[gpus."GPU-abc"]\nonline_memory_reserve = "1GiB"\noffline_sm_pct_max = 50\n'
    )
    assert cfg.for_gpu(0, "GPU-none") == config.GpuConfig(
        shared=True, online_memory_reserve_bytes=2 << 30, offline_sm_pct_max=80.0, max_clients=20
    )
    assert cfg.for_gpu(1, "GPU-none") == config.GpuConfig(
        shared=False, online_memory_reserve_bytes=2 << 30, offline_sm_pct_max=80.0, max_clients=4
    )
    # The UUID entry wins entirely: what it leaves out is the node-wide value, not index 1's.
    assert cfg.for_gpu(1, "GPU-abc") == config.GpuConfig(
        shared=True, online_memory_reserve_bytes=1 << 30, offline_sm_pct_max=50.0, max_clients=20
    )


@pytest.mark.parametrize(
    ("text", "key", "hint"),
    [
        ("bogus = 1", "bogus", "unknown key; valid keys here"),
        ("[control]\nperoid = '1s'", "control.peroid", "valid keys here: comfort_ratio"),
        ("[nonsense]\nx = 1", "nonsense", "unknown key"),
        ("control = 3", "control", "expected a table"),
        ("[control]\nperiod = true", "control.period", "duration such as"),
        ("[control]\nperiod = '5 parsecs'", "control.period", "duration such as"),
        ("[control]\nperiod = 0", "control.period", "out of range"),
        (
            "[control]\nonline_memory_reserve = '12Q'",
            "control.online_memory_reserve",
            "size such as",
        ),
        ("[control]\nonline_memory_reserve = -5", "control.online_memory_reserve", "size such as"),
        ("[control]\ncomfort_ratio = 1.5", "control.comfort_ratio", "<= 1.0"),
        ("[control]\ncomfort_ratio = 'high'", "control.comfort_ratio", "expected a number"),
        ("[control]\nincrease_after_ticks = 2.5", "control.increase_after_ticks", "an integer"),
        ("[control]\nincrease_after_ticks = true", "control.increase_after_ticks", "an integer"),
        ("[mps]\ncompute_mode = 'shared'", "mps.compute_mode", "'exclusive_process', 'leave'"),
        ("[mps]\nmax_clients = 0", "mps.max_clients", "out of range"),
        ("[probe]\nenabled = 'yes'", "probe.enabled", "true or false"),
        ("[daemon]\nlog_level = 'loud'", "daemon.log_level", "one of 'debug'"),
        ("[daemon]\nsocket_mode = '999'", "daemon.socket_mode", "octal mode"),
        ("[daemon]\nsocket_mode = 666", "daemon.socket_mode", "a string"),
        ("[metrics]\nlisten = 'localhost'", "metrics.listen", "HOST:PORT"),
        ("[metrics]\nlisten = 'h:99999'", "metrics.listen", "HOST:PORT"),
        ("[paths]\nruntime_dir = 'relative/dir'", "paths.runtime_dir", "absolute path"),
        ("[paths]\nsocket = ''", "paths.socket", "a path string"),
        ("[gpus.'zero']\nshared = true", "gpus.zero", "index"),
        ("[gpus.'0']\nshared = 1", "gpus.0.shared", "true or false"),
        ("[gpus.'0']\nbogus = 1", "gpus.0.bogus", "unknown key"),
        ("[gpus.'0']\noffline_sm_pct_max = 0", "gpus.0.offline_sm_pct_max", "out of range"),
        ("version = 2", "version", "unsupported version"),
        (
            "[control]\noffline_sm_pct_min = 60\noffline_sm_pct_max = 50\noffline_sm_pct_default = 55",
            "control.offline_sm_pct_min",
            "must not exceed",
        ),
        ("[control]\noffline_sm_pct_default = 5", "control.offline_sm_pct_default", "between"),
        ("[paths]\ninflight_library = 'lib/x.so'", "paths.inflight_library", "absolute path"),
        ("[control]\nhard_ratio = 1.0\nviolation_ratio = 1.2", "control.hard_ratio", "at least"),
        (
            "[control]\ngate_delay_min = '50ms'\ngate_delay_max = '10ms'",
            "control.gate_delay_min",
            "must not exceed control.gate_delay_max",
        ),
        ("[control]\ngate_delay_min = 0", "control.gate_delay_min", "out of range"),
        ("[control]\ngate_delay_max = '-1s'", "control.gate_delay_max", "duration such as"),
        ("[control]\ngate_delay_trust = 'soon'", "control.gate_delay_trust", "duration such as"),
        (
            "[control]\ngate_delay_raise_after_ticks = 0",
            "control.gate_delay_raise_after_ticks",
            "out of range",
        ),
        (
            "[mps]\nrestart_backoff_min = '1m'\nrestart_backoff_max = '1s'",
            "mps.restart_backoff_min",
            "must not exceed",
        ),
    ],
)
def test_bad_values_name_file_key_and_fix(text, key, hint):
    with pytest.raises(ConfigError) as info:
        config.loads(text, "/etc/gpushare/gpushare.toml")
    err = info.value
    assert err.file == "/etc/gpushare/gpushare.toml"
    assert err.key == key
    assert hint in str(err)
    assert str(err).startswith(f"/etc/gpushare/gpushare.toml: {key}: ")


def test_toml_syntax_error_names_the_file(tmp_path: Path):
    bad = tmp_path / "g.toml"
    bad.write_text("[control\nperiod = 1")
    with pytest.raises(ConfigError, match=r"g\.toml: not valid TOML"):
        config.load(bad)


def test_missing_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read the file: No such file"):
        config.load(tmp_path / "absent.toml")


def test_unreadable_file(tmp_path: Path):
    # A directory in place of the file: unreadable whoever runs the test (root included).
    with pytest.raises(ConfigError, match="cannot read the file"):
        config.load(tmp_path)


def test_binary_file(tmp_path: Path):
    f = tmp_path / "g.toml"
    f.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match="not UTF-8"):
        config.load(f)
