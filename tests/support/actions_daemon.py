"""What the tests of the run loop and of the appliers of the controller's actions share.

They drive the in-process daemon of tests/daemon/conftest.py's ``env`` fixture tick by tick: the
caller they submit as, the GPU its scripted policy controls, and a submit of an offline client;
and what every in-process daemon fixture does last (:func:`stop_daemon`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any

from gpushare.daemon.core import Daemon
from gpushare.daemon.server import Caller
from gpushare.node.procs.identity import is_same_process
from tests.fakes.fake_gpu import fake_uuid

#: The caller the tests submit as (this process, root).
ROOT = Caller(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())

#: The GPU the scripted policy controls.
GPU0 = fake_uuid(0)


def _submit(d: Daemon, argv: list[str], **kw: Any) -> dict[str, Any]:
    """Submits ``argv`` as a detached offline client on GPU 0, as root; ``kw`` adds parameters."""
    params = {"cls": "offline", "argv": argv, "detach": True, "cwd": "/", "gpu": "0",
              "env": {"PATH": os.environ["PATH"]}, **kw}  # fmt: skip
    return d.api.submit(ROOT, params)


#: A workload that keeps a CPU busy (its CPU time shows what the pauser let it run).
BUSY = [sys.executable, "-c", "while True: pass"]


def stop_daemon(d: Daemon) -> None:
    """Kill what is left of the clients ``d`` started, then shut it down and close its registry.

    Each recorded client still the same process gets its group killed (and continued, so that a
    frozen one dies at once): a client that dies between the check and the signal must not leak.
    """
    for rec in d.registry.clients(include_final=True):
        if rec.pid and rec.start_time and is_same_process(rec.pid, rec.start_time):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rec.pid, signal.SIGKILL)
                os.killpg(rec.pid, signal.SIGCONT)
    d.shutdown()
    d.registry.close()
