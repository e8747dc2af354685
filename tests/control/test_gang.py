"""The gang rules of control/gang.py: placement by run fraction, the gang duty and its wrapper."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from bench.support.observations import observation
from gpushare.control import gang
from gpushare.control.gang import (
    FoundGang,
    GangDuty,
    GpuForGang,
    RankFacts,
    gang_duty,
    group_ranks,
    place_gang,
    run_fraction,
)
from gpushare.model import Action, Observation, SetDuty

GIB = 1 << 30


def gpu(i: int, free_gib: float = 10.0, **services: float) -> GpuForGang:
    return GpuForGang(i, int(free_gib * GIB), services)


def test_run_fraction_counts_a_tp_server_once() -> None:
    # Two GPUs of one TP server are busy at the same moments: one factor, not two.
    assert run_fraction([gpu(0, tp=0.5), gpu(1, tp=0.5)]) == pytest.approx(0.5)
    assert run_fraction([gpu(0, a=0.5), gpu(1, b=0.5)]) == pytest.approx(0.25)
    assert run_fraction([gpu(0), gpu(1)]) == 1.0


def test_idle_gpus_first() -> None:
    gpus = [gpu(0, a=0.3), gpu(1, b=0.3), gpu(2), gpu(3)]
    placed = place_gang(gpus, 2, 4 * GIB)
    assert placed is not None and placed.gpus == (2, 3) and placed.run_fraction == 1.0


def test_a_tp_servers_gpus_before_separate_services() -> None:
    # Where the gang must share, three GPUs of one TP server (load 0.5) cost it less than three
    # one-GPU services (0.3 each): 0.5 against 0.7 ** 3 = 0.343. Per-GPU memory alone (D12)
    # would pick the services' GPUs, which have more free memory.
    gpus = [gpu(i, 8, tp=0.5) for i in range(4)] + [
        gpu(4 + i, 12, **{f"s{i}": 0.3}) for i in range(3)
    ]
    gpus.append(gpu(7, 14))
    placed = place_gang(gpus, 4, 4 * GIB)
    assert placed is not None
    assert placed.gpus == (0, 1, 2, 7)
    assert placed.services == ("tp",)
    assert placed.run_fraction == pytest.approx(0.5)


def test_memory_must_fit_and_too_few_gpus_is_none() -> None:
    gpus = [gpu(0, 2), gpu(1, 10, a=0.9), gpu(2, 10)]
    placed = place_gang(gpus, 2, 4 * GIB)
    assert placed is not None and placed.gpus == (1, 2)
    assert place_gang(gpus, 3, 4 * GIB) is None
    with pytest.raises(ValueError, match="at least one rank"):
        place_gang(gpus, 0, GIB)


def test_ties_go_to_the_lowest_indices() -> None:
    placed = place_gang([gpu(i) for i in range(6)], 3, GIB)
    assert placed is not None and placed.gpus == (0, 1, 2)


def test_greedy_beyond_the_exact_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gang, "MAX_EXACT_COMBINATIONS", 1)
    gpus = [gpu(0, a=0.5), gpu(1), gpu(2, b=0.2), gpu(3)]
    placed = place_gang(gpus, 3, GIB)
    assert placed is not None and placed.gpus == (1, 2, 3)
    assert placed.run_fraction == pytest.approx(0.8)


def test_gang_duty_is_the_smallest() -> None:
    assert gang_duty({"a": 0.4, "b": 0.9}, ["a", "b", "c"]) == 0.4
    assert gang_duty({}, ["a"]) == 1.0
    assert math.isclose(gang_duty({"a": 0.2}, []), 1.0)


class FixedDuty:
    """A one-GPU policy that emits a given duty once per GPU (as the controller: on change)."""

    name = "fixed"
    offline_mps_priority = 1

    def __init__(self, duties: dict[str, float]) -> None:
        self.duties = duties

    def initial_state(self, gpu_uuid: str, now: float) -> float:
        return 1.0

    def step(
        self, state: float, observation: Observation, now: float
    ) -> tuple[float, Sequence[Action]]:
        want = self.duties[observation.gpu_uuid]
        if want == state:
            return state, []
        return want, [SetDuty(observation.gpu_uuid, want, "fixed")]


def obs(uuid: str) -> Observation:
    return observation(gpu=uuid)


def test_gang_duty_wrapper_sends_the_gangs_smallest_duty() -> None:
    inner = FixedDuty({"g0": 0.3, "g1": 1.0, "g2": 0.5})
    policy = GangDuty(inner, [["g0", "g1"]])
    s0, a0 = policy.step(1.0, obs("g0"), 0.0)
    assert [(a.gpu_uuid, a.duty) for a in a0 if isinstance(a, SetDuty)] == [("g0", 0.3)]
    # g1's own duty is 1 (it sends nothing), but the gang's slowest GPU holds 0.3.
    _, a1 = policy.step(1.0, obs("g1"), 0.0)
    assert [(a.gpu_uuid, a.duty) for a in a1 if isinstance(a, SetDuty)] == [("g1", 0.3)]
    assert "gang duty" in a1[0].reason
    # A GPU outside every gang keeps the inner policy's own actions.
    _, a2 = policy.step(1.0, obs("g2"), 0.0)
    assert [(a.gpu_uuid, a.duty) for a in a2 if isinstance(a, SetDuty)] == [("g2", 0.5)]
    # Nothing changed: nothing is sent again.
    _, again = policy.step(s0, obs("g0"), 1.0)
    assert again == []


# ------------------------------------------------------------------------------ adoption


def rank(pid: int, gpu: str | None, local: str | None, *, ppid: int = 10, uid: int = 1000,
         run: str = "r1", cls: str = "offline", env: dict[str, str] | None = None) -> RankFacts:  # fmt: skip
    environ = {"TORCHELASTIC_RUN_ID": run} if env is None else dict(env)
    if local is not None:
        environ["LOCAL_RANK"] = local
    return RankFacts(pid, ppid, uid, cls, gpu, environ)


def test_ranks_of_one_parent_are_one_gang_in_rank_order() -> None:
    found = group_ranks([rank(21, "g1", "1"), rank(20, "g0", "0")], {10: 1000})
    assert found.gangs == (FoundGang(10, (20, 21), ("g0", "g1")),) and not found.deferred
    # rank-exec's workers: LOCAL_RANK is 0 in each, the launcher's rank in GPUSHARE_LOCAL_RANK.
    ex = [rank(30 + k, f"g{k}", "0", env={"GPUSHARE_GANG": "[..]", "GPUSHARE_LOCAL_RANK": str(k)})
          for k in (1, 0)]  # fmt: skip
    assert group_ranks(ex, {10: 1000}).gangs[0].pids == (30, 31)


def test_what_is_not_one_users_job_over_distinct_gpus_is_no_gang() -> None:
    pair = [rank(20, "g0", "0"), rank(21, "g1", "1")]
    assert group_ranks(pair, {10: 0}).gangs == ()  # a root-owned parent (slurmstepd)
    assert group_ranks(pair, {}).gangs == ()  # a parent not seen (or setuid: left out)
    assert group_ranks([pair[0], rank(21, "g1", "1", uid=1001)], {10: 1000}).gangs == ()
    assert group_ranks([pair[0], rank(21, "g1", "1", run="r2")], {10: 1000}).gangs == ()
    assert group_ranks([pair[0], rank(21, "g1", "1", cls="online")], {10: 1000}).gangs == ()
    assert group_ranks([pair[0], rank(21, "g0", "1")], {10: 1000}).gangs == ()  # one GPU
    assert group_ranks([pair[0], rank(21, "g1", "0")], {10: 1000}).gangs == ()  # one rank twice
    assert group_ranks([pair[0], rank(21, "g1", None)], {10: 1000}).gangs == ()
    assert group_ranks([pair[0], rank(21, None, "1")], {10: 1000}).gangs == ()
    assert (
        group_ranks([rank(20, "g0", "0", ppid=1), rank(21, "g1", "1", ppid=1)], {1: 1000}).gangs
        == ()
    )


def test_ranks_of_a_parent_with_a_rank_too_young_to_decide_wait_for_the_next_scan() -> None:
    found = group_ranks([rank(20, "g0", "0"), rank(21, "g1", "1")], {10: 1000}, unsettled={10})
    assert found.gangs == () and found.deferred == {20, 21}
