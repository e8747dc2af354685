"""The memory promised to a GPU's clients that NVML does not show yet (gpushare/control/promise.py).

The rule both placements count: ``submit`` (tests/control/test_placement.py) and the controller's
admission of queued jobs (tests/control/test_admission.py).
"""

from __future__ import annotations

import pytest

from bench.support.observations import offline, online
from gpushare.control.promise import (
    PROMISE_WINDOW_S,
    PlacedClient,
    may_promise,
    promised_bytes,
    promised_to_views,
)
from gpushare.model import ClientState

S = ClientState
GIB = 1 << 30
MIB = 1 << 20
NOW = 1_000.0


@pytest.mark.parametrize(
    ("state", "started_at", "expected"),
    [
        (S.STARTING, None, True),  # spawning: no process yet
        (S.RESTARTING, NOW - 3600, True),  # its memory comes back with the new process
        (S.RUNNING, NOW - 1, True),
        (S.RUNNING, NOW - PROMISE_WINDOW_S + 0.1, True),
        (S.RUNNING, NOW - PROMISE_WINDOW_S, False),  # NVML's reading stands alone from here
        (S.THROTTLED, NOW - 5, True),
        (S.FROZEN, NOW - 5, True),
        (S.RUNNING, None, False),  # no start time: an old record, NVML is trusted
        (S.QUEUED, None, False),  # not on a GPU yet
        (S.EXITED, NOW - 1, False),
        (S.FAILED, NOW - 1, False),
        (S.LOST, NOW - 1, False),
    ],
)
def test_which_clients_may_still_promise_memory(
    state: ClientState, started_at: float | None, expected: bool
) -> None:
    assert may_promise(state, started_at, NOW) is expected


@pytest.mark.parametrize(
    ("clients", "expected"),
    [
        ([], 0),
        ([PlacedClient(None, S.STARTING, None)], 0),  # no --mem: size unknown, nothing promised
        ([PlacedClient(4 * GIB, S.STARTING, None)], 4 * GIB),
        ([PlacedClient(4 * GIB, S.RUNNING, NOW - 2)], 4 * GIB),  # NVML lists none of its pids
        ([PlacedClient(4 * GIB, S.RUNNING, NOW - 2, 0)], 4 * GIB),
        ([PlacedClient(4 * GIB, S.RUNNING, NOW - 2, 512 * MIB)], 4 * GIB - 512 * MIB),
        ([PlacedClient(4 * GIB, S.RUNNING, NOW - 2, 6 * GIB)], 0),  # above its --mem: all shown
        ([PlacedClient(4 * GIB, S.RUNNING, NOW - PROMISE_WINDOW_S - 1)], 0),
        ([PlacedClient(4 * GIB, S.EXITED, NOW - 2)], 0),
        (
            [
                PlacedClient(4 * GIB, S.STARTING, None),
                PlacedClient(8 * GIB, S.RUNNING, NOW - 10, 1 * GIB),
                PlacedClient(None, S.RUNNING, NOW - 10),
                PlacedClient(2 * GIB, S.RUNNING, NOW - 600),
            ],
            4 * GIB + 7 * GIB,
        ),
    ],
)
def test_promised_memory(clients: list[PlacedClient], expected: int) -> None:
    assert promised_bytes(clients, NOW) == expected


def test_a_controller_view_promises_its_pinned_memory_limit() -> None:
    view = offline("x", state=S.RUNNING, mem=1 * GIB, mem_limit=4 * GIB, started=NOW - 2)
    assert PlacedClient.of(view) == PlacedClient(4 * GIB, S.RUNNING, NOW - 2, 1 * GIB)
    views = [
        view,
        offline("y", state=S.STARTING, mem=None, mem_limit=2 * GIB),
        offline("z", state=S.RUNNING, mem=None, mem_limit=8 * GIB, started=NOW - PROMISE_WINDOW_S),
        online(mem=None),  # no --mem
    ]
    assert promised_to_views(views, NOW) == 3 * GIB + 2 * GIB
