"""kill -9 of a test daemon at one step of a client restart (``GPUSHARE_TEST_CRASH_AT=<step>``).

Installed by tests/support/daemon_proc.py into the real daemon's objects: the production code has
no fault hooks. ``GPUSHARE_TEST_RESTART_ONCE=1`` (or a file's path: once it exists) has the
controller ask for one restart of the first running restartable client (the real controller restarts clients when the offline share
moves, which a fake GPU cannot be made to do on cue).

Steps, in the order a restart takes them:

- ``signalled``: RESTARTING recorded, the checkpoint signal sent; the process may still run.
- ``exited``: the process exited; the relaunch has not begun.
- ``prepared``: STARTING recorded for the relaunch; nothing spawned.
- ``spawned``: the new process runs in the client's cgroup; the registry does not know its pid.
- ``recorded``: the new process is recorded and adopted.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpushare.daemon.core import Daemon
from gpushare.model import Action, ClientState, Observation, RestartClient

STEPS = ("signalled", "exited", "prepared", "spawned", "recorded")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(daemon: Daemon) -> None:
    """Wrap the daemon's lifecycle (and policy) as the environment asks."""
    if os.environ.get("GPUSHARE_TEST_RESTART_ONCE"):
        _restart_once(daemon)
    step = os.environ.get("GPUSHARE_TEST_CRASH_AT")
    if not step:
        return
    assert step in STEPS, step
    life = daemon.lifecycle
    relaunching = [False]
    restart, launch = life.restart, life.launch_detached
    prepare, spawn, finish = life.prepare_launch, life.spawn, life.finish_launch

    def restart_then(action: RestartClient, now: float) -> None:
        restart(action, now)
        if (
            step == "signalled"
            and daemon.registry.get(action.client_id).state is ClientState.RESTARTING
        ):
            _die()

    def launch_then(*args: Any, restart: bool = False, **kw: Any) -> Any:
        if restart and step == "exited":
            _die()
        relaunching[0] = restart
        return launch(*args, restart=restart, **kw)

    def after(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kw: Any) -> Any:
            out = fn(*args, **kw)
            if relaunching[0] and step == name:
                _die()
            return out

        return wrapped

    life.restart = restart_then  # type: ignore[method-assign]
    life.launch_detached = launch_then  # type: ignore[method-assign]
    life.prepare_launch = after("prepared", prepare)  # type: ignore[method-assign]
    life.spawn = after("spawned", spawn)  # type: ignore[method-assign]
    life.finish_launch = after("recorded", finish)  # type: ignore[method-assign]


def _restart_once(daemon: Daemon) -> None:
    """Ask one restart; with a path instead of ``1``, only once that file exists."""
    policy = daemon.state.policy
    step = policy.step
    asked = [False]
    flag = os.environ["GPUSHARE_TEST_RESTART_ONCE"]

    def step_and_restart(state: Any, obs: Observation, now: float) -> tuple[Any, Sequence[Action]]:
        state, actions = step(state, obs, now)
        if asked[0] or (flag != "1" and not Path(flag).exists()):
            return state, actions
        for rec in daemon.registry.clients(check=False):
            # Running for a second: the submit that started it has had its answer.
            started = rec.started_at is not None and time.time() - rec.started_at > 1.0
            if rec.restartable and rec.state is ClientState.RUNNING and started:
                asked[0] = True
                return state, [*actions, RestartClient(rec.id, None, "test: restart once")]
        return state, actions

    policy.step = step_and_restart  # type: ignore[method-assign]
