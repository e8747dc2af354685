"""Root runs the MPS binaries only when no other user could have changed them (gpushare.trust).

Stand-in front ends (shell scripts that leave a mark when they run) in a root-only directory,
then given to an unprivileged uid: the supervisor must refuse to start MPS with one clear line,
the front end must not run for a command after a swap, and ``doctor`` must not run it either.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpushare.config import Config, MpsConfig, PathsConfig
from gpushare.node import mps
from gpushare.node.mps import MpsSetupError, MpsSupervisor

NOBODY = 65534
GPU = "GPU-00000000-0000-0000-0000-00000000abcd"


def _script(directory: Path, name: str, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True, mode=0o755)
    path = directory / name
    path.write_text(f"#!/bin/sh\ntouch {directory}/ran-{name}\ncat >/dev/null\n{body}\n")
    path.chmod(0o755)
    return path


def _supervisor(control: Path, base: Path, extra_path: list[Path]) -> MpsSupervisor:
    # Under the short trusted directory: the pipe directory's socket paths must fit 108 bytes.
    config = Config(
        paths=PathsConfig(runtime_dir=base / "r", state_dir=base / "s"),
        mps=MpsConfig(control_binary=str(control), ready_timeout_s=0.5, compute_mode="leave"),
    )
    return MpsSupervisor(GPU, config, extra_path=[str(p) for p in extra_path])


def test_a_control_binary_of_another_user_is_never_started(trusted_tmp: Path) -> None:
    control = _script(trusted_tmp / "bin", "nvidia-cuda-mps-control", "exit 1")
    os.chown(control, NOBODY, NOBODY)
    sup = _supervisor(control, trusted_tmp, [])
    with pytest.raises(MpsSetupError) as err:
        sup.start()
    assert f"the MPS control binary {control} is not trusted: {control} is owned by uid" in str(
        err.value
    )
    assert f"chown root:root {control} && chmod go-w {control}" in str(err.value)
    assert not (trusted_tmp / "bin" / "ran-nvidia-cuda-mps-control").exists()


def test_a_server_binary_another_user_could_replace_stops_the_start(trusted_tmp: Path) -> None:
    # The control front end is root's and finds no daemon; the server it would start is not.
    control = _script(
        trusted_tmp / "bin", "nvidia-cuda-mps-control",
        "echo 'Cannot find MPS control daemon process' >&2; exit 1",
    )  # fmt: skip
    sbin = trusted_tmp / "sbin"
    server = _script(sbin, "nvidia-cuda-mps-server", "exit 0")
    sbin.chmod(0o777)
    sup = _supervisor(control, trusted_tmp, [sbin])
    with pytest.raises(MpsSetupError) as err:
        sup.start()
    assert str(err.value).startswith(
        f"refusing to start MPS: the MPS server binary {server} is not trusted: {sbin} is "
        "writable by group or others (mode 0777)"
    )
    assert not (sbin / "ran-nvidia-cuda-mps-server").exists()


def test_a_front_end_swapped_after_a_good_command_is_not_run_again(trusted_tmp: Path) -> None:
    control = _script(trusted_tmp / "bin", "nvidia-cuda-mps-control", "echo 100.0")
    ctl = mps.MpsControl(control, trusted_tmp, timeout_s=2.0)
    assert ctl.get_default_active_thread_percentage() == 100.0
    mark = trusted_tmp / "bin" / "ran-nvidia-cuda-mps-control"
    mark.unlink()
    os.chown(control, NOBODY, NOBODY)
    with pytest.raises(MpsSetupError, match="refusing to run it: the MPS control binary"):
        ctl.get_default_active_thread_percentage()
    assert not mark.exists()


def test_doctor_does_not_run_an_untrusted_control_binary(trusted_tmp: Path) -> None:
    control = _script(trusted_tmp / "bin", "nvidia-cuda-mps-control", "exit 0")
    (trusted_tmp / "bin").chmod(0o1777)
    ok, detail, hint = mps.binary_status(str(control))
    assert not ok
    assert detail.startswith(f"the MPS control binary {control} is not trusted: ")
    assert "sticky" in detail and hint
    assert not (trusted_tmp / "bin" / "ran-nvidia-cuda-mps-control").exists()
