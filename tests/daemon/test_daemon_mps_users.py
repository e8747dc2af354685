"""The daemon end to end under legacy (single-user) MPS: one user per GPU, a gang holding every GPU
it spans for its user.

A real daemon process, real socket, SQLite, signals and workloads; only the GPU
(tests/fakes/fake_gpu.py) and the MPS side (tests/fakes/fake_mps.py) are fakes.
"""

from __future__ import annotations

import os

from bench.support.daemon_helpers import DaemonProc, call_as
from tests.fakes.fake_gpu import fake_uuid
from tests.support.daemon_e2e import NOBODY, needs_root


@needs_root
def test_one_user_per_gpu_without_multiuser_mps() -> None:
    d = DaemonProc()
    try:
        d.start()
        d.submit_detached(["sleep", "30"], gpu="1")
        params = {"cls": "offline", "argv": ["sleep", "30"], "detach": True, "cwd": "/",
                  "env": {"PATH": os.environ["PATH"]}}  # fmt: skip
        refused = call_as(
            NOBODY, NOBODY, d.socket, "submit", {**params, "gpu": "1", "no_queue": True}
        )
        assert refused["error"] == "NO_CAPACITY"
        assert "one user at a time" in refused["message"]
        placed = call_as(NOBODY, NOBODY, d.socket, "submit", {**params, "gpu": "any"})
        assert placed["result"]["gpu_uuid"] == fake_uuid(0)
    finally:
        d.cleanup()


@needs_root
def test_a_gang_of_one_user_keeps_another_users_clients_off_every_gpu_it_uses() -> None:
    # Legacy MPS serves one uid per GPU: root's gang on GPUs 0 and 1 holds both for root, so
    # another user's submit to GPU 1 (not rank 0's GPU) is refused, and its gang cannot span it.
    d = DaemonProc()
    try:
        d.start()
        gang = d.submit_detached(["sleep", "30"], gpus="0,1")
        assert gang["gpu_uuid"] == fake_uuid(0)
        params = {"cls": "offline", "argv": ["sleep", "30"], "detach": True, "cwd": "/",
                  "env": {"PATH": os.environ["PATH"]}, "no_queue": True}  # fmt: skip
        for where in ({"gpu": "1"}, {"gpus": "2"}):
            refused = call_as(NOBODY, NOBODY, d.socket, "submit", {**params, **where})
            assert refused["error"] == "NO_CAPACITY", (where, refused)
            assert "one user at a time" in refused["message"]
    finally:
        d.cleanup()
