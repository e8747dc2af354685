"""Facts of running processes (``process_facts``) and the freeze route of an adopted one.

Real processes, real ``/proc``, real cgroup v2: the cgroups are created beside this process's own
and removed with every process in them at teardown.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from gpushare.control.adoption import FACT_ENV
from gpushare.model import PauseMechanism
from gpushare.node.cgroups.discovery import cgroup2_mount
from gpushare.node.cgroups.route import freeze_route
from gpushare.node.procs.facts import (
    all_pids,
    cgroup_v2_path,
    process_cgroup,
    process_facts,
    read_environ,
    unit_of_cgroup,
)
from gpushare.node.procs.identity import is_same_process, process_start_time, stat_fields
from gpushare.node.procs.users import user_name

CGROUP_SKIP = cgroup_skip_reason()
needs_cgroup = pytest.mark.skipif(CGROUP_SKIP is not None, reason=CGROUP_SKIP or "")


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    popens: list[subprocess.Popen[bytes]] = []
    yield popens
    for p in popens:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait(timeout=10)


@pytest.fixture
def cg() -> Iterator[Path]:
    if CGROUP_SKIP is not None:
        pytest.skip(CGROUP_SKIP)
    base = unique_base("gs-facts-test")
    base.mkdir()
    yield base
    remove_tree(base)


def _sleep(started: list[subprocess.Popen[bytes]], **env: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sleep", "60"], env={"PATH": os.environ["PATH"], **env})
    started.append(proc)
    # Until it execs, /proc/<pid>/environ is still the forking parent's; and the new image's
    # environment (like its arguments) is readable only once the kernel has laid out its stack,
    # after `comm` already says "sleep" and after Popen has returned: wait for the arguments.
    deadline = time.monotonic() + 5
    while Path(f"/proc/{proc.pid}/cmdline").read_bytes() != b"sleep\x0060\x00":
        assert time.monotonic() < deadline, "sleep did not start"
        time.sleep(0.005)
    return proc


def _mount() -> Path:
    mount = cgroup2_mount()
    assert mount is not None
    return mount


def test_facts_of_a_marked_process_keep_only_the_variables_asked_for(started):
    proc = _sleep(started, GPUSHARE_CLASS="offline", API_TOKEN="secret", SLURM_JOB_ID="7")
    facts = process_facts(proc.pid, [*FACT_ENV, "SLURM_JOB_ID"], gpu_pids={proc.pid: ("GPU-a",)})
    assert facts is not None
    assert facts.environ == {"GPUSHARE_CLASS": "offline", "SLURM_JOB_ID": "7"}
    assert (facts.pid, facts.ppid, facts.uid, facts.name) == (
        proc.pid,
        os.getpid(),
        os.getuid(),
        "sleep",
    )
    assert facts.user == user_name(os.getuid())
    assert is_same_process(proc.pid, facts.start_time)
    # /proc read directly, on psutil's clock: a registry's start time compares with it.
    assert abs(facts.start_time - (process_start_time(proc.pid) or 0)) < 1e-6
    assert facts.cgroup == process_cgroup(os.getpid())
    assert facts.gpu_uuids == ("GPU-a",)
    assert process_facts(proc.pid, FACT_ENV).gpu_uuids is None  # type: ignore[union-attr]
    assert process_facts(proc.pid, FACT_ENV, gpu_pids={}).gpu_uuids == ()  # type: ignore[union-attr]


def test_a_gone_process_or_a_zombie_has_no_facts(started):
    proc = _sleep(started)
    proc.kill()
    time.sleep(0.2)  # exited, not yet reaped: a zombie still has /proc/<pid>
    assert Path(f"/proc/{proc.pid}/stat").exists()
    assert process_facts(proc.pid, FACT_ENV) is None
    proc.wait()
    assert process_facts(proc.pid, FACT_ENV) is None
    assert read_environ(proc.pid, FACT_ENV) is None


def test_processes_exiting_while_they_are_read_never_raise():
    # Read each short-lived process over and over while it starts, runs and exits: every read
    # gives its own facts or None, never an exception or another process's facts.
    for _ in range(20):
        proc = subprocess.Popen(["sh", "-c", "exit 0"])
        deadline = time.monotonic() + 5
        while (f := process_facts(proc.pid, FACT_ENV)) is not None:
            assert f.pid == proc.pid
            assert time.monotonic() < deadline, "the process never exited"
        proc.wait()


def test_kernel_threads_have_no_facts():
    kthreads = [pid for pid in all_pids()
                if (s := stat_fields(pid)) is not None and int(s[6]) & 0x00200000]  # fmt: skip
    if not kthreads:
        pytest.skip("no kernel thread is visible in this pid namespace")
    assert process_facts(kthreads[0], FACT_ENV) is None


@pytest.mark.parametrize(
    ("path", "unit"),
    [
        ("/system.slice/triton.service", "triton.service"),
        ("/system.slice/docker-4f1c.scope", "docker-4f1c.scope"),
        ("/user.slice/user-1000.slice/user@1000.service/app.slice/serve.service", "serve.service"),
        ("/user.slice/user-1000.slice/session-3.scope", "session-3.scope"),
        ("/system.slice/gpushare.service/client-7", "gpushare.service"),
        ("/system.slice/slurmstepd.scope/job_42/step_0/user/task_0", "slurmstepd.scope"),
        ("/kubepods.slice/kubepods-besteffort.slice", None),
        ("/", None),
        (None, None),
    ],
)
def test_unit_of_cgroup(path, unit):
    assert unit_of_cgroup(path) == unit


def test_cgroup_v2_path_reads_the_0_line_of_a_hybrid_host():
    text = "12:memory:/x\n1:name=systemd:/user.slice\n0::/system.slice/a.service\n"
    assert cgroup_v2_path(text) == "/system.slice/a.service"
    assert cgroup_v2_path("4:memory:/x\n") is None


@needs_cgroup
def test_a_process_alone_in_its_cgroup_is_frozen_through_it(started, cg: Path):
    leaf = cg / "svc"
    leaf.mkdir()
    proc = _sleep(started)
    (leaf / "cgroup.procs").write_text(str(proc.pid))
    facts = process_facts(proc.pid, FACT_ENV)
    assert facts is not None and facts.cgroup == "/" + str(leaf.relative_to(_mount()))
    route = freeze_route(proc.pid, [proc.pid])
    assert route.mechanism is PauseMechanism.CGROUP
    assert route.cgroup == leaf
    assert route.reason == f"cgroup freezer on its own cgroup: {leaf}"
    # The route is real: freezing through it stops the process.
    (leaf / "cgroup.freeze").write_text("1")
    deadline = time.monotonic() + 5
    while "frozen 1" not in (leaf / "cgroup.events").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (leaf / "cgroup.freeze").write_text("0")


@needs_cgroup
def test_a_cgroup_shared_with_another_process_needs_sigstop(started, cg: Path):
    leaf = cg / "session"
    leaf.mkdir()
    mine, theirs = _sleep(started), _sleep(started)
    for p in (mine, theirs):
        (leaf / "cgroup.procs").write_text(str(p.pid))
    route = freeze_route(mine.pid, [mine.pid])
    assert route.mechanism is PauseMechanism.SIGNAL and route.cgroup is None
    assert (
        route.reason
        == f"SIGSTOP/SIGCONT: {leaf} also holds pid {theirs.pid}, which is not part of the client"
    )
    assert freeze_route(mine.pid, [mine.pid, theirs.pid]).mechanism is PauseMechanism.CGROUP


@needs_cgroup
def test_a_delegated_cgroup_is_named_as_such(started, cg: Path):
    leaf = cg / "delegated"
    leaf.mkdir()
    try:
        os.setxattr(cg, "trusted.delegate", b"1")
    except OSError as exc:
        pytest.skip(f"this kernel's cgroupfs takes no trusted.* xattr: {exc.strerror}")
    proc = _sleep(started)
    (leaf / "cgroup.procs").write_text(str(proc.pid))
    route = freeze_route(proc.pid, [proc.pid])
    assert route.reason == f"cgroup freezer on a delegated cgroup: {leaf}"


@needs_cgroup
def test_the_root_cgroup_and_a_gone_process_need_sigstop(started, cg: Path):
    proc = _sleep(started)
    mount = _mount()
    (mount / "cgroup.procs").write_text(str(proc.pid))
    route = freeze_route(proc.pid, [proc.pid])
    assert route.mechanism is PauseMechanism.SIGNAL
    assert route.reason == "SIGSTOP/SIGCONT: it is in the root cgroup, which cannot be frozen"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone = freeze_route(proc.pid, [proc.pid])
    assert gone.reason == f"SIGSTOP/SIGCONT: pid {proc.pid} has no cgroup v2 (gone?)"


def test_without_cgroup_v2_the_route_is_sigstop(started, tmp_path: Path):
    proc = _sleep(started)
    (tmp_path / "mounts").write_text("proc /proc proc rw 0 0\n")
    assert cgroup2_mount(tmp_path / "mounts") is None
    route = freeze_route(proc.pid, [proc.pid], mount=None)
    if cgroup2_mount() is not None:
        # mount=None means "discover"; a host with cgroup v2 finds it, so ask with a fake mount.
        route = freeze_route(proc.pid, [proc.pid], mount=tmp_path / "not-cgroupfs")
        assert route.mechanism is PauseMechanism.SIGNAL
    else:
        assert route.reason == "SIGSTOP/SIGCONT: no cgroup v2 is mounted"
