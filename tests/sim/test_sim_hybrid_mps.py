"""``gpushare daemon --simulate N`` with the real MPS control binary (gpushare/sim/hybrid_mps.py).

The merging rules of :class:`HybridMpsNode` are checked with fakes; the daemon itself is run as a
real process on one simulated GPU with the real ``nvidia-cuda-mps-control`` (skipped, with the
reason, only where the binary is not installed and cannot be fetched).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.support.cgroup_helpers import remove_tree
from bench.support.trusted import make_trusted_dir
from gpushare import config as config_mod
from gpushare.cli.render import render_status
from gpushare.model import MpsEventKind, MpsState
from gpushare.node.mps import DaemonNotReachable, MpsControl, MpsError
from gpushare.roots.daemon import StartupError, simulated_mps
from gpushare.sim.hybrid_mps import HybridMpsNode, merge_state
from gpushare.sim.realtime import RealTimeMpsNode, RealTimeSimNode
from tests.fakes.fake_mps import FakeMpsNode
from tests.support.sim_daemon_helpers import SimDaemon, run_daemon, sim_config, sim_daemon

UUID = "GPU-sim-0000"

# ------------------------------------------------------------------------------------------------
# The composite node with fakes


def _hybrid() -> tuple[HybridMpsNode, FakeMpsNode, FakeMpsNode, list[str]]:
    order: list[str] = []
    real = FakeMpsNode([UUID], Path("/real"), name="real", log=order)
    sim = FakeMpsNode([UUID], Path("/sim"), name="sim", log=order)
    return HybridMpsNode(real, sim), real, sim, order


@pytest.mark.parametrize(
    ("real", "sim", "want"),
    [
        (MpsState.UP, MpsState.UP, MpsState.UP),
        (MpsState.UP, MpsState.FAULT, MpsState.FAULT),  # a simulated server fault shows
        (MpsState.UP, MpsState.UNKNOWN, MpsState.UNKNOWN),
        (MpsState.DOWN, MpsState.UP, MpsState.DOWN),  # the real daemon died
        (MpsState.STARTING, MpsState.UP, MpsState.STARTING),  # it is being restarted
        (MpsState.DOWN, MpsState.FAULT, MpsState.DOWN),  # no recovery through a dead daemon
        (MpsState.FAULT, MpsState.UP, MpsState.FAULT),
    ],
)
def test_state_is_the_real_daemons_unless_it_is_up(
    real: MpsState, sim: MpsState, want: MpsState
) -> None:
    assert merge_state(real, sim) is want
    node, r, s, _ = _hybrid()
    r.set_state(UUID, real)
    s.set_state(UUID, sim)
    assert node.state(UUID) is want


def test_pipe_dir_and_events_come_from_both_sides() -> None:
    node, real, sim, _ = _hybrid()
    assert node.pipe_dir(UUID) == Path("/real") / UUID
    real.push_event(UUID, MpsEventKind.DAEMON_EXITED, "killed")
    real.push_event(UUID, MpsEventKind.DAEMON_RESTARTED, "")
    sim.push_event(UUID, MpsEventKind.FATAL_EXCEPTION, "simulated fault")
    kinds = [e.kind for e in node.drain_events(UUID)]
    assert kinds == [
        MpsEventKind.DAEMON_EXITED,
        MpsEventKind.DAEMON_RESTARTED,
        MpsEventKind.FATAL_EXCEPTION,
    ]
    assert node.drain_events(UUID) == []  # drained on both sides


def test_terminate_acts_on_both_and_survives_the_real_daemons_errors() -> None:
    node, real, sim, order = _hybrid()
    sim.connect_client(UUID, 4242)  # the simulated GPU knows the client, the real daemon not
    assert node.terminate_client(UUID, 4242) is True
    assert order == ["real.terminate_client", "sim.terminate_client"]
    # The real daemon of a simulated GPU knows no such client, or is unreachable: no crash.
    real.fail_next("terminate_client", DaemonNotReachable("no daemon"))
    assert node.terminate_client(UUID, 4242) is False  # gone from the simulated GPU too
    assert sim.calls[-1] == ("terminate_client", (UUID, 4242))
    real.connect_client(UUID, 7)
    assert node.terminate_client(UUID, 7) is True


def test_recover_acts_on_both_even_when_the_real_side_fails() -> None:
    node, real, sim, order = _hybrid()
    real.fail_next("recover", DaemonNotReachable("restarting"))
    node.recover(UUID, [1, 2], [3])
    assert order == ["real.recover", "sim.recover"]
    assert sim.recovered == [(UUID, (1, 2), (3,))]


def test_stop_always_quits_the_real_daemons() -> None:
    node, real, _, _ = _hybrid()
    node.start()
    node.stop(quit_daemon=False)  # daemon.stop_mps_on_exit = false does not keep them
    assert real.calls == [("start", ()), ("stop", (True,))]


# ------------------------------------------------------------------------------------------------
# Choosing real or simulated MPS


def _config(tmp_path: Path, binary: str) -> config_mod.Config:
    return config_mod.loads(
        f"""version = 1
[paths]
runtime_dir = "{tmp_path}/run"
state_dir = "{tmp_path}/state"
[mps]
control_binary = "{binary}"
"""
    )


def test_absent_binary_means_simulated_mps_with_the_reason(tmp_path: Path) -> None:
    cfg = _config(tmp_path, str(tmp_path / "absent" / "nvidia-cuda-mps-control"))
    rt = RealTimeSimNode(1, cfg, runtime_dir=cfg.paths.runtime_dir)
    node, info = simulated_mps(cfg, rt)
    assert isinstance(node, RealTimeMpsNode)
    assert info["mps"] == "simulated"
    assert "not found" in info["reason"]
    assert "scripts/get-mps-control.sh" in info["reason"]
    assert not (tmp_path / "run" / "mps" / UUID).exists()  # nothing was started


def test_installed_but_broken_binary_fails_startup_naming_the_fix(
    tmp_path: Path, trusted_tmp: Path
) -> None:
    broken = trusted_tmp / "nvidia-cuda-mps-control"
    broken.write_text("#!/bin/sh\necho 'cannot execute: Exec format error' >&2\nexit 126\n")
    broken.chmod(0o755)
    cfg = _config(tmp_path, str(broken))
    rt = RealTimeSimNode(1, cfg, runtime_dir=cfg.paths.runtime_dir)
    with pytest.raises(StartupError) as err:
        simulated_mps(cfg, rt)
    assert str(broken) in str(err.value)
    assert "mps.control_binary" in str(err.value)


def test_status_view_says_whether_mps_is_real_on_simulated_gpus() -> None:
    gpu = {
        "index": 0, "uuid": UUID, "shared": True, "mem_used_bytes": 0, "mem_total_bytes": 1 << 34,
        "gpu_util_pct": 0.0, "mps_state": "up", "mps_backend": "real",
        "online_slo": {"state": "ok"}, "probe": {"enabled": False, "latency_ms": None},
        "client_slots_used": 0, "client_slots_max": 48, "duty": 1.0, "offline_sm_pct": 50.0,
        "error": None,
    }  # fmt: skip
    daemon = {"version": "0.1.0", "summary": "1 GPU(s)", "simulated": True}
    text = render_status({"daemon": daemon, "gpus": [gpu], "clients": []})
    assert "(simulated GPUs)" in text.splitlines()[0]
    assert text.splitlines()[3].split()[4:6] == ["up", "(real)"]
    text = render_status({"daemon": daemon, "gpus": [{**gpu, "mps_backend": "simulated"}],
                          "clients": []})  # fmt: skip
    assert text.splitlines()[3].split()[4:6] == ["up", "(sim)"]
    # A real node: the plain state, as before.
    real_node = {"version": "0.1.0", "summary": "1 GPU(s)", "simulated": False}
    text = render_status({"daemon": real_node, "gpus": [gpu], "clients": []})
    assert "(real)" not in text
    assert "simulated" not in text


# ------------------------------------------------------------------------------------------------
# The daemon process with the real binary


def _control_daemons(binary: Path) -> dict[int, str]:
    """pid -> CUDA_MPS_PIPE_DIRECTORY of every running ``<binary> -f``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv[:2] != [os.fsencode(binary), b"-f"]:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        pipe = next((e[24:] for e in env if e.startswith(b"CUDA_MPS_PIPE_DIRECTORY=")), b"")
        out[int(entry.name)] = os.fsdecode(pipe)
    return out


def _daemons_on(binary: Path, pipe_dir: Path) -> list[int]:
    return [pid for pid, d in _control_daemons(binary).items() if d == str(pipe_dir)]


def _wait(pred: Callable[[], object], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


_MPS_REST = 'default_active_thread_pct = 60\nhealth_period = "0.5s"'


def _pipe_dir(base: Path) -> Path:
    return base / "run" / "mps" / UUID


def _kill_control_daemons(mps_control: Path) -> Callable[[Path], None]:
    def kill(base: Path) -> None:
        # Whatever the test saw, leave no control daemon of this test running.
        for pid in _daemons_on(mps_control, _pipe_dir(base)):
            os.kill(pid, signal.SIGKILL)

    return kill


@pytest.fixture
def real_mps_sim_daemon(mps_control: Path) -> Iterator[SimDaemon]:
    with sim_daemon(mps_control, rest=_MPS_REST, after=_kill_control_daemons(mps_control)) as d:
        yield d


@pytest.mark.mps
def test_simulate_runs_supervises_and_stops_the_real_control_daemon(
    real_mps_sim_daemon: SimDaemon, tmp_path: Path
) -> None:
    d = real_mps_sim_daemon
    binary, pipe_dir = d.mps_control, _pipe_dir(d.base)
    # One real control daemon for the simulated GPU, on the configured pipe directory, with the
    # configured default applied.
    assert len(_daemons_on(binary, pipe_dir)) == 1
    ctl = MpsControl(binary, pipe_dir)
    assert ctl.get_default_active_thread_percentage() == 60.0
    (line,) = [x for x in d.log_lines() if x["event"] == "simulated_node"]
    assert line["mps"] == "real"
    assert line["binary"] == str(binary)

    status = json.loads(d.cli("status", "--json").stdout)
    (gpu,) = status["gpus"]
    assert (gpu["mps_state"], gpu["mps_backend"], status["daemon"]["simulated"]) == (
        "up",
        "real",
        True,
    )
    assert "up (real)" in d.cli("status").stdout

    # A client submitted through the CLI reaches that daemon through its own environment.
    out = tmp_path / "client.out"
    script = (
        'printf "%s\\n" "$CUDA_MPS_PIPE_DIRECTORY" > "$1"; '
        'echo get_default_active_thread_percentage | "$0" >> "$1" 2>&1; exec sleep 60'
    )
    res = d.cli(
        "submit", "--offline", "--detach", "--name", "train", "--sim-profile", "resnet50-train",
        "--", "sh", "-c", script, str(binary), str(out),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    _wait(lambda: len(out.read_text().splitlines()) >= 2 if out.exists() else False, "the client")
    assert out.read_text().splitlines()[:2] == [str(pipe_dir), "60.0"]

    # kill -9 of the control daemon is noticed; it is restarted and its defaults re-applied. The
    # one running now: on a loaded host a health check that timed out may have replaced the first.
    (current,) = _daemons_on(binary, pipe_dir)
    os.kill(current, signal.SIGKILL)
    _wait(
        lambda: [p for p in _daemons_on(binary, pipe_dir) if p != current], "a new control daemon"
    )
    _wait(lambda: "mps_daemon_restarted" in d.events(), "the mps_daemon_restarted event")
    assert "mps_daemon_exited" in d.events()

    def reapplied() -> bool:
        try:
            return ctl.get_default_active_thread_percentage() == 60.0
        except MpsError:
            return False

    _wait(reapplied, "the default active thread percentage re-applied")
    _wait(
        lambda: json.loads(d.cli("status", "--json").stdout)["gpus"][0]["mps_state"] == "up",
        "MPS up again",
    )

    # Stop: the simulated GPUs vanish, so do their control daemons (stop_mps_on_exit = false).
    assert d.cli("cancel", res.stdout.split()[0]).returncode == 0
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=20) == 0
    assert _daemons_on(binary, pipe_dir) == []
    assert not (pipe_dir / "control").exists()


@pytest.mark.mps
def test_a_second_daemon_on_the_same_directories_leaves_the_first_alone(
    real_mps_sim_daemon: SimDaemon,
) -> None:
    d = real_mps_sim_daemon
    pipe_dir = _pipe_dir(d.base)
    (first,) = _daemons_on(d.mps_control, pipe_dir)
    second = run_daemon(d.base)
    assert second.returncode == 1
    assert "another gpushare daemon is serving" in second.stderr
    assert _daemons_on(d.mps_control, pipe_dir) == [first]
    assert MpsControl(d.mps_control, pipe_dir).get_default_active_thread_percentage() == 60.0


@pytest.mark.mps
def test_a_failed_start_leaves_no_control_daemon(mps_control: Path) -> None:
    base = make_trusted_dir("gsh-")  # the daemon refuses a config under /tmp
    cgroup_dir = None
    try:
        # The control daemon starts, then the API socket cannot be set up.
        cgroup_dir = sim_config(base, mps_control, daemon='socket_group = "gpushare-no-such-group"')
        res = run_daemon(base)
        assert res.returncode == 1
        assert "daemon.socket_group" in res.stderr
        assert '"mps_daemon_ready"' in res.stderr  # it did start, and was stopped again
        assert _daemons_on(mps_control, _pipe_dir(base)) == []
        assert not (_pipe_dir(base) / "control").exists()
    finally:
        _kill_control_daemons(mps_control)(base)
        shutil.rmtree(base, ignore_errors=True)
        if cgroup_dir is not None:
            remove_tree(cgroup_dir)


def test_a_control_daemon_that_cannot_start_fails_startup_naming_the_fix(
    mps_control: Path, tmp_path: Path
) -> None:
    deep = tmp_path / ("d" * 100)  # the MPS socket path would not fit in a Unix socket address
    cfg = _config(deep, str(mps_control))
    rt = RealTimeSimNode(1, cfg, runtime_dir=cfg.paths.runtime_dir)
    with pytest.raises(StartupError) as err:
        simulated_mps(cfg, rt)
    assert "paths.mps_pipe_dir" in str(err.value)
    assert _daemons_on(mps_control, deep / "run" / "mps" / UUID) == []
