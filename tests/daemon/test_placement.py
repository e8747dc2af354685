"""The placement rule of ``submit --gpu any`` (gpushare/daemon/placement.py), table-driven."""

from __future__ import annotations

import itertools

import pytest

from gpushare.daemon.placement import (
    PROMISE_WINDOW_S,
    TIE_BYTES,
    GpuLoad,
    PlacedClient,
    choose,
    may_promise,
    promised_bytes,
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


def _gpu(index: int, free_gib: float | None, promised_gib: float = 0, clients: int = 0) -> GpuLoad:
    free = None if free_gib is None else int(free_gib * GIB)
    return GpuLoad(index, f"GPU-{index}", free, int(promised_gib * GIB), clients)


@pytest.mark.parametrize(
    ("gpus", "expected", "why"),
    [
        ([_gpu(0, 80), _gpu(1, 80)], 0, "all equal: the lowest index"),
        ([_gpu(0, 80, clients=1), _gpu(1, 80)], 1, "equal memory: the fewest clients"),
        (
            [_gpu(0, 80, clients=2), _gpu(1, 79.5, clients=1)],
            1,
            "within the tie: the fewest clients though less memory",
        ),
        (
            [_gpu(0, 79.5, clients=1), _gpu(1, 80, clients=1)],
            1,
            "tied on memory and clients: the most memory",
        ),
        (
            [_gpu(0, 80, clients=3), _gpu(1, 70, clients=0)],
            0,
            "10 GiB more is not a tie: memory first",
        ),
        (
            [_gpu(0, 80, promised_gib=10), _gpu(1, 75)],
            1,
            "promised memory counts: 70 available against 75",
        ),
        (
            [_gpu(0, 80, promised_gib=0.5, clients=1), _gpu(1, 80, clients=1)],
            1,
            "a promise under the tie still ranks by memory among equals",
        ),
        ([_gpu(0, None), _gpu(1, 1)], 1, "unknown free memory only when none is known"),
        ([_gpu(0, None, clients=2), _gpu(1, None, clients=1)], 1, "all unknown: fewest clients"),
        ([_gpu(3, 80), _gpu(1, 80), _gpu(2, 80)], 1, "the lowest index, not the first listed"),
    ],
)
def test_choose(gpus: list[GpuLoad], expected: int, why: str) -> None:
    assert choose(gpus).index == expected, why
    # Deterministic: the order the GPUs are listed in does not matter.
    for order in itertools.permutations(gpus):
        assert choose(list(order)).index == expected, why


def test_tie_is_inclusive_at_its_bound() -> None:
    at = [_gpu(0, 80, clients=1), GpuLoad(1, "GPU-1", 80 * GIB - TIE_BYTES, 0, 0)]
    assert choose(at).index == 1
    beyond = [_gpu(0, 80, clients=1), GpuLoad(1, "GPU-1", 80 * GIB - TIE_BYTES - 1, 0, 0)]
    assert choose(beyond).index == 0


def test_choose_needs_a_gpu() -> None:
    with pytest.raises(ValueError, match="no GPU"):
        choose([])


def _burst(free_gib: list[float], submits: int, mem_gib: float | None) -> list[int]:
    """Submit after submit before NVML shows any of them: where each goes."""
    loads = [_gpu(i, f) for i, f in enumerate(free_gib)]
    placed = []
    for _ in range(submits):
        best = choose(loads)
        placed.append(best.index)
        loads[best.index] = GpuLoad(
            best.index, best.uuid, best.free_bytes,
            best.promised_bytes + int((mem_gib or 0) * GIB), best.clients + 1,
        )  # fmt: skip
    return placed


@pytest.mark.parametrize(
    ("free_gib", "submits", "mem_gib", "expected"),
    [
        # The case: idle GPUs and clients of unknown size spread one per GPU in turn.
        ([80] * 8, 8, None, list(range(8))),
        ([16] * 4, 8, None, [0, 1, 2, 3, 0, 1, 2, 3]),
        # Idle GPUs that differ by MiBs (driver, MPS server, probe contexts) are still equal.
        ([79.6, 79.9, 79.7, 79.8], 4, None, [1, 3, 2, 0]),
        # Declared memory spreads by itself, and fills the emptiest GPU first.
        ([80, 80, 40], 4, 20, [0, 1, 0, 1]),
        ([80, 80, 40], 6, 20, [0, 1, 0, 1, 2, 0]),
    ],
)
def test_a_burst_of_submits_spreads(
    free_gib: list[float], submits: int, mem_gib: float | None, expected: list[int]
) -> None:
    assert _burst(free_gib, submits, mem_gib) == expected
