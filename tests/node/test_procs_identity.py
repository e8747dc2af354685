"""Process identity (gpushare.node.procs.identity) with real processes.

A pid plus its start time names one process (a recycled pid or a zombie is not it), missing
records, descendants, process-group members and the stopped state.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil

from gpushare.node.procs.identity import (
    descendants,
    group_members,
    is_same_process,
    is_stopped,
    process_start_time,
    process_uid,
)
from tests.support.processes import Procs
from tests.support.processes import wait_for as _wait


def test_start_time_identity(started: Procs) -> None:
    proc = started.add(subprocess.Popen(["sleep", "30"]))
    start = process_start_time(proc.pid)
    assert start is not None
    assert abs(start - psutil.Process(proc.pid).create_time()) < 1e-6
    assert abs(start - time.time()) < 60
    assert is_same_process(proc.pid, start)
    assert not is_same_process(proc.pid, start - 5.0)  # a recycled pid started at another time
    proc.kill()
    # A zombie has finished: not the live process any more.
    assert _wait(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE)
    assert not is_same_process(proc.pid, start)
    proc.wait()
    assert process_start_time(proc.pid) is None
    assert not is_same_process(proc.pid, start)


def test_identity_of_missing_records() -> None:
    for pid in (0, -1):
        assert process_start_time(pid) is None
        assert not is_same_process(pid, time.time())
        assert process_uid(pid) is None
        assert descendants(pid) == []
    assert not is_same_process(os.getpid(), None)
    assert is_same_process(os.getpid(), process_start_time(os.getpid()))


def test_descendants_and_group_members(started: Procs) -> None:
    proc = started.add(
        subprocess.Popen(
            ["sh", "-c", "sleep 30 & sleep 30 & wait"],
            start_new_session=True,
        )
    )
    assert _wait(lambda: len(descendants(proc.pid)) == 2)
    assert group_members(proc.pid) == sorted([proc.pid, *descendants(proc.pid)])
    assert group_members(os.getpgrp()) != group_members(proc.pid)
    os.killpg(proc.pid, signal.SIGSTOP)
    assert _wait(lambda: all(is_stopped(p) for p in group_members(proc.pid)))
    os.killpg(proc.pid, signal.SIGCONT)
    assert _wait(lambda: not is_stopped(proc.pid))
