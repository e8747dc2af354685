"""``gpushare env`` and :mod:`gpushare.mpsenv`: the variables, each output format, bad input."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.support.daemon_helpers import DaemonProc
from gpushare import mpsenv
from gpushare.cli.app import app
from gpushare.model import ClientClass
from gpushare.roots import envresolve as env_cmd

runner = CliRunner()
UUID = "GPU-8a2f1c3e-1111-2222-3333-444455556666"


def _config(tmp_path: Path, extra: str = "") -> Path:
    f = tmp_path / "g.toml"
    f.write_text(f'[paths]\nruntime_dir = "{tmp_path}/run"\n{extra}')
    return f


def _env(*args: str, cfg: Path) -> tuple[int, str, str]:
    # A socket path nobody listens on: the daemon lookup must fail fast and cleanly.
    result = runner.invoke(
        app, ["env", *args, "--config", str(cfg), "--socket", str(cfg.parent / "none.sock")]
    )
    return result.exit_code, result.stdout, result.stderr


def _shell_env(script: str) -> dict[str, str]:
    out = subprocess.run(
        ["sh", "-c", f"{script}\nenv -0"],
        env={"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": "3"},
        capture_output=True,
        check=True,
    ).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def test_offline_shell_lines_give_a_shell_the_mps_limits(tmp_path: Path):
    code, out, err = _env(
        "--offline", "--gpu", UUID, "--mem", "8G", "--sm", "30", cfg=_config(tmp_path)
    )
    assert code == 0, err
    env = _shell_env(out)
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == f"{tmp_path}/run/mps/{UUID}"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{UUID}=8G"
    assert env["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert env["GPUSHARE_CLASS"] == "offline"
    assert "GPUSHARE_SLO_P99" not in env
    assert env["GPUSHARE_LATENCY_SOCKET"] == f"{tmp_path}/run/latency.sock"


def test_defaults_come_from_the_config_file(tmp_path: Path):
    cfg = _config(tmp_path, '[control]\noffline_sm_pct_default = 35\npolicy = "mps"\n')
    code, out, err = _env("--offline", "--gpu", UUID, "--json", cfg=cfg)
    assert code == 0, err
    env = json.loads(out)["env"]
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "35"
    # The plain-MPS baseline runs offline work at normal priority.
    assert env["CUDA_MPS_CLIENT_PRIORITY"] == "0"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env


def test_online_gets_the_whole_gpu_normal_priority_and_its_slo(tmp_path: Path):
    code, out, err = _env(
        "--online", "--gpu", UUID, "--slo-p99", "0.04", "--json", cfg=_config(tmp_path)
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert data["env"]["CUDA_MPS_CLIENT_PRIORITY"] == "0"
    assert data["env"]["GPUSHARE_SLO_P99"] == "40ms"
    assert data["unset"] == ["CUDA_VISIBLE_DEVICES"]
    assert data["gpu"] == {"index": None, "uuid": UUID}


def test_systemd_drop_in_quotes_values_as_systemd_reads_them():
    text = mpsenv.render({"A": 'x "y" 50%', "B": "plain"}, "systemd")
    assert text.splitlines() == [
        "[Service]",
        "UnsetEnvironment=CUDA_VISIBLE_DEVICES",
        'Environment="A=x \\"y\\" 50%%"',
        'Environment="B=plain"',
    ]


def test_docker_env_file_is_literal_and_cannot_unset():
    text = mpsenv.render({"A": "a b", "B": "c"}, "docker")
    assert text.splitlines() == [
        "# do not set CUDA_VISIBLE_DEVICES in the container",
        "A=a b",
        "B=c",
    ]


def test_slurm_lines_are_unquoted_because_slurm_takes_them_literally():
    text = mpsenv.render({"A": "a b"}, "slurm")
    assert text.splitlines() == ["unset CUDA_VISIBLE_DEVICES", "export A=a b"]


@pytest.mark.parametrize("fmt", ["shell", "systemd", "docker", "slurm"])
def test_a_newline_in_a_value_is_refused_in_every_format(fmt):
    with pytest.raises(ValueError, match="newline"):
        mpsenv.render({"A": "x\ny"}, fmt)


def test_blanks_slurm_would_drop_are_refused():
    with pytest.raises(ValueError, match="blanks"):
        mpsenv.render({"A": " x"}, "slurm")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", UUID], "exactly one of --online or --offline"),
        (["--online", "--offline", "--gpu", UUID], "exactly one of --online or --offline"),
        (["--offline", "--gpu", UUID, "--sm", "0"], "--sm must be a percentage in (0, 100]"),
        (["--offline", "--gpu", UUID, "--sm", "101"], "--sm must be a percentage in (0, 100]"),
        (["--offline", "--gpu", UUID, "--sm", "nan"], "'nan' is not a finite number"),
        (["--offline", "--gpu", UUID, "--sm", "1e999"], "'1e999' is not a finite number"),
        (["--offline", "--gpu", UUID, "--sm", "5e-324"], "'5e-324' is too small"),
        (["--offline", "--gpu", UUID, "--mem", "lots"], "--mem: expected a size"),
        (["--offline", "--gpu", UUID, "--mem", "512K"], "--mem must be at least 1M"),
        (["--offline", "--gpu", UUID, "--slo-p99", "40ms"], "applies to --online workloads only"),
        (["--online", "--gpu", UUID, "--slo-p99", "soon"], "--slo-p99: expected a duration"),
        (["--online", "--gpu", UUID, "--slo-p99", "0"], "--slo-p99 must be a positive duration"),
        (["--online", "--gpu", UUID, "--format", "yaml"], "--format must be one of"),
        (["--online", "--gpu", "GPU-zz"], "is not a GPU UUID"),
        (["--online", "--gpu", "first"], "an index (0, 1, ...) or a UUID"),
    ],
)
def test_bad_values_exit_2_with_the_fix_and_print_nothing(tmp_path: Path, args, message):
    code, out, err = _env(*args, cfg=_config(tmp_path))
    assert code == 2
    assert out == ""
    assert message in err


def test_a_bad_config_file_is_named(tmp_path: Path):
    cfg = _config(tmp_path, "[control]\noffline_sm_pct_default = 500\n")
    code, out, err = _env("--offline", "--gpu", UUID, cfg=cfg)
    assert code == 2
    assert out == ""
    assert "control.offline_sm_pct_default: out of range" in err


def test_a_gpu_that_is_not_shared_is_refused(tmp_path: Path):
    cfg = _config(tmp_path, f'[gpus."{UUID}"]\nshared = false\n')
    code, _out, err = _env("--offline", "--gpu", UUID, cfg=cfg)
    assert code == 2
    assert "not shared by gpushare" in err


def test_without_daemon_or_nvml_an_index_cannot_be_resolved(tmp_path: Path):
    with pytest.raises(env_cmd.GpuLookupError) as err:
        env_cmd.resolve_gpu("0", [lambda: "the daemon did not answer", lambda: "no NVML"])
    assert err.value.exit_code == 1
    assert "the daemon did not answer; no NVML" in str(err.value)
    assert "UUID" in str(err.value)


def test_gpu_lookup_tries_the_next_source_and_checks_the_index():
    sources = [lambda: "down", lambda: [(0, "GPU-a"), (1, "GPU-b")]]
    assert env_cmd.resolve_gpu("1", sources) == (1, "GPU-b")
    with pytest.raises(env_cmd.GpuLookupError, match="no GPU with index 7"):
        env_cmd.resolve_gpu("7", sources)
    with pytest.raises(env_cmd.GpuLookupError, match="2 GPUs here, give --gpu"):
        env_cmd.resolve_gpu(None, sources)
    assert env_cmd.resolve_gpu(None, [lambda: [(0, "GPU-only")]]) == (0, "GPU-only")


def test_the_running_daemon_names_the_gpu_of_an_index():
    d = DaemonProc(gpus=2)
    try:
        d.start()
        gpus = d.call("status")["gpus"]
        result = runner.invoke(
            app,
            ["env", "--offline", "--gpu", "1", "--json", "--config", str(d.config_path),
             "--socket", str(d.socket)],
        )  # fmt: skip
        assert result.exit_code == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["gpu"] == {"index": 1, "uuid": gpus[1]["uuid"]}
        assert data["env"]["CUDA_MPS_PIPE_DIRECTORY"] == f"{d.base}/run/mps/{gpus[1]['uuid']}"
        several = runner.invoke(
            app, ["env", "--offline", "--config", str(d.config_path), "--socket", str(d.socket)]
        )
        assert several.exit_code == 2
        assert "2 GPUs here, give --gpu" in several.stderr
        # What the daemon launches a submitted workload with is what `gpushare env` prints for
        # the same request: both come from gpushare.mpsenv. (A deep queue: an --offline job's
        # default queue, auto since issue 32, adds the launcher's in-flight variables.)
        submitted = d.submit_detached(
            ["sleep", "30"], gpu="1", sm_pct=30.0, mem_bytes=2 << 30, queue="deep"
        )
        d.call("cancel", {"client_id": submitted["client_id"]})
        printed = runner.invoke(
            app,
            ["env", "--offline", "--gpu", "1", "--sm", "30", "--mem", "2G", "--json",
             "--config", str(d.config_path), "--socket", str(d.socket)],
        )  # fmt: skip
        assert printed.exit_code == 0, printed.stderr
        env = json.loads(printed.stdout)["env"]
        assert {k: v for k, v in submitted["env"].items() if k != "GPUSHARE_CLIENT_ID"} == env
        assert env["GPUSHARE_CLASS"] == "offline"
        assert submitted["unset_env"] == list(mpsenv.UNSET_ENV)
    finally:
        d.cleanup()


def test_the_pure_parts_match_what_the_daemon_launches_with():
    limits = mpsenv.MpsLimits(gpu_uuid=UUID, sm_pct=12.5, mem_bytes=1536 << 20, priority=1)
    env = mpsenv.mps_env(
        limits=limits, pipe_dir=Path("/p"), latency_socket=Path("/l"), client_id="c1"
    )
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "12.5"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{UUID}=1536M"
    assert env["GPUSHARE_CLIENT_ID"] == "c1"
    assert mpsenv.priority(ClientClass.ONLINE, 1) == 0
    assert mpsenv.priority(ClientClass.OFFLINE, 1) == 1
    assert mpsenv.default_sm_pct(ClientClass.ONLINE, 40.0) == 100.0
    assert mpsenv.default_sm_pct(ClientClass.OFFLINE, 40.0) == 40.0


def test_paths_come_from_the_daemon_asked_not_the_local_config(tmp_path: Path) -> None:
    # A daemon on a non-default socket with its own runtime directory; this host's config names
    # another: the workload must reach the daemon's MPS and latency socket (b0c0ecb printed the
    # local config's pipe directory).
    d = DaemonProc(gpus=1)
    try:
        d.start()
        local = _config(tmp_path)  # runtime_dir under tmp_path, not the daemon's
        result = runner.invoke(
            app, ["env", "--offline", "--gpu", "0", "--json", "--config", str(local),
                  "--socket", str(d.socket)],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        uuid = out["gpu"]["uuid"]
        assert out["env"]["CUDA_MPS_PIPE_DIRECTORY"] == f"{d.base}/run/mps/{uuid}"
        assert out["env"]["GPUSHARE_LATENCY_SOCKET"] == f"{d.base}/run/latency.sock"
        assert str(tmp_path) not in result.stdout
    finally:
        d.cleanup()
