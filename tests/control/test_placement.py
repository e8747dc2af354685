"""The placement rule of ``submit --gpu any`` (gpushare/daemon/placement.py), table-driven."""

from __future__ import annotations

import itertools

import pytest

from gpushare.control.placement import TIE_BYTES, GpuLoad, choose

GIB = 1 << 30


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
