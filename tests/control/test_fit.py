"""The one fit rule: slots, one user at a time, memory beside the reserve; one wording for both paths."""

from __future__ import annotations

from bench.support.observations import GIB, gpu_uuid, job, observation, online
from gpushare.control.admission import plan
from gpushare.control.fit import LOST, Room, misfit, size
from gpushare.model import MpsState

ROOM = Room(closed=None, max_clients=4, probe_slots=1, live=1, available_bytes=10 * GIB)


def test_a_client_that_fits_has_no_reason() -> None:
    assert misfit(ROOM, 10 * GIB) is None
    assert misfit(ROOM, None) is None


def test_closed_slots_users_then_memory() -> None:
    assert misfit(Room(LOST, 4, 1, 0, None), None) == LOST
    full = Room(None, max_clients=3, probe_slots=1, live=2, available_bytes=10 * GIB)
    assert misfit(full, GIB) == "all 3 MPS client slots are taken (2 clients + the latency probe)"
    shared = Room(None, 4, 0, 1, 10 * GIB, other_users=("alice",))
    assert (misfit(shared, GIB) or "").startswith("MPS serves one user at a time here and alice")
    short = Room(None, 4, 1, 1, 10 * GIB, promised_bytes=3 * GIB, reserve_bytes=2 * GIB)
    assert misfit(short, 8 * GIB) is None  # exactly the 8 GiB left beside the reserve
    assert misfit(short, 8 * GIB + 1) == (
        f"needs {size(10 * GIB + 1)} with 2G kept for online clients, 10G free after 3G promised "
        "to clients that do not use their --mem yet"
    )


def test_nothing_left_beside_the_reserve_refuses_even_an_undeclared_client() -> None:
    # The admission's rule, now submit's too: a client always needs some memory.
    assert misfit(Room(None, 4, 0, 0, 2 * GIB, reserve_bytes=2 * GIB), None) is not None
    assert misfit(Room(None, 4, 0, 0, None, reserve_bytes=2 * GIB), None) is None  # unknown


def test_sizes_are_exact_when_whole_and_two_decimals_otherwise() -> None:
    assert (size(2 * GIB), size(1536 << 20), size(int(3.68 * GIB))) == ("2G", "1536M", "3.68G")


def test_admission_says_a_shortage_in_the_rule_s_words() -> None:
    # 80 GiB GPU, online holds 10 GiB, reserve 2 GiB: what submit would say for the same job.
    obs = observation((online(mem=10 * GIB),), gpu=gpu_uuid(0), index=0)
    assert obs.mps_state is MpsState.UP
    waiting = plan([job("big", mem=70 * GIB)], {obs.gpu_uuid: obs}, {}, now=0.0).waiting["big"]
    room = Room(None, 48, 1, 1, 70 * GIB, reserve_bytes=obs.mem_reserve_bytes)
    assert waiting == f"cannot start: GPU 0: {misfit(room, 70 * GIB)}"
