"""The drain after a freeze (gpushare.daemon.drain): NVML evidence where it exists, else a bound."""

from __future__ import annotations

from gpushare.daemon.drain import DEEP_DRAIN_S, SHALLOW_DRAIN_S, DrainTracker
from gpushare.model import SmPeriod

GPU = "GPU-0"
PIDS: dict[str, list[int]] = {"c1": [101, 102], "c2": [201]}


def test_without_per_process_readings_the_queue_mode_bounds_the_drain() -> None:
    d = DrainTracker()
    d.note_paused({"c1"}, now=10.0, wall=1000.0)
    d.observe(GPU, None, PIDS)  # no per-process utilisation on this GPU
    assert not d.drained("c1", GPU, 10.0 + SHALLOW_DRAIN_S / 2, shallow=True)
    assert d.drained("c1", GPU, 10.0 + SHALLOW_DRAIN_S, shallow=True)
    assert not d.drained("c1", GPU, 10.0 + SHALLOW_DRAIN_S, shallow=False)
    assert d.drained("c1", GPU, 10.0 + DEEP_DRAIN_S, shallow=False)
    assert not d.drained("c2", GPU, 99.0, shallow=True)  # not frozen: never "drained"


def test_a_client_never_listed_busy_is_judged_by_the_bound() -> None:
    """Under MPS the driver may attribute all SM use to the server: absence then proves nothing."""
    d = DrainTracker()
    d.observe(GPU, [SmPeriod(999.0, (7,))], PIDS)  # only the MPS server's pid
    d.note_paused({"c1"}, now=10.0, wall=1000.0)
    d.observe(GPU, [SmPeriod(1000.1, (7,))], PIDS)
    assert not d.drained("c1", GPU, 10.1, shallow=False)
    assert d.drained("c1", GPU, 10.0 + DEEP_DRAIN_S, shallow=False)


def test_an_attributed_client_drains_at_the_first_period_without_it() -> None:
    d = DrainTracker()
    d.observe(GPU, [SmPeriod(999.9, (102, 7))], PIDS)  # c1's second process used the SMs
    d.note_paused({"c1"}, now=10.0, wall=1000.0)
    # A period that ended before the freeze says nothing; one after it listing c1: still busy.
    d.observe(GPU, [SmPeriod(1000.0, (7,))], PIDS)
    assert not d.drained("c1", GPU, 10.05, shallow=True)
    d.observe(GPU, [SmPeriod(1000.1, (101, 7))], PIDS)
    # Busy after the freeze beats the bound: the queue is still draining.
    assert not d.drained("c1", GPU, 10.0 + DEEP_DRAIN_S, shallow=False)
    d.observe(GPU, [SmPeriod(1000.2, (101,)), SmPeriod(1000.3, (7,))], PIDS)
    assert d.drained("c1", GPU, 10.3, shallow=False)
    # Thawed and frozen again: the drain starts over.
    d.note_paused(set(), now=10.4, wall=1000.4)
    assert not d.drained("c1", GPU, 10.4, shallow=False)
    d.note_paused({"c1"}, now=10.5, wall=1000.5)
    assert not d.drained("c1", GPU, 10.5, shallow=False)
    d.observe(GPU, [SmPeriod(1000.6, ())], PIDS)
    assert d.drained("c1", GPU, 10.6, shallow=False)


def test_no_period_since_the_freeze_falls_back_on_the_bound() -> None:
    """An idle GPU gives no per-process samples at all (NOT_FOUND): the bound decides."""
    d = DrainTracker()
    d.observe(GPU, [SmPeriod(999.9, (201,))], PIDS)
    d.note_paused({"c2"}, now=10.0, wall=1000.0)
    d.observe(GPU, (), PIDS)
    assert not d.drained("c2", GPU, 10.5, shallow=False)
    assert d.drained("c2", GPU, 10.0 + DEEP_DRAIN_S, shallow=False)


def test_forget_drops_gone_clients() -> None:
    d = DrainTracker()
    d.observe(GPU, [SmPeriod(999.9, (201,))], PIDS)
    d.note_paused({"c2"}, now=10.0, wall=1000.0)
    d.forget([])
    d.note_paused({"c2"}, now=11.0, wall=1001.0)  # a new client reusing the id: unattributed
    d.observe(GPU, [SmPeriod(1001.1, ())], PIDS)
    assert not d.drained("c2", GPU, 11.2, shallow=False)
