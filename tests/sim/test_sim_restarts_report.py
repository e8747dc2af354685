"""Issue 32: every report row and the ``gpushare sim`` JSON say how often a policy restarted jobs."""

from __future__ import annotations

from gpushare.sim.report import restarts_per_job_hour
from gpushare.sim.results import OfflineResult, RunResult


def _run(virtual_s: float, jobs: int, restarts: int) -> RunResult:
    offline = [OfflineResult(f"j{i}", 10, 1.0, 2.0, "running", None) for i in range(jobs)]
    return RunResult(
        scenario="s", policy="gpushare", virtual_s=virtual_s, wall_s=1.0, online=[],
        offline=offline, busy_fraction=0.5, sm_active_fraction=0.5, mem_peak_bytes=0,
        mem_total_bytes=1, actions={"RestartClient": restarts} if restarts else {}, kernels={},
    )  # fmt: skip


def test_restarts_are_counted_per_hour_of_offline_job_time() -> None:
    # The figure: 5 restarts of one job in 300 s is 60 per job-hour.
    assert restarts_per_job_hour(_run(300.0, 1, 5)) == 60.0
    # Two jobs for an hour, 3 restarts: 1.5 per job-hour; none: 0.
    assert restarts_per_job_hour(_run(3600.0, 2, 3)) == 1.5
    assert restarts_per_job_hour(_run(3600.0, 2, 0)) == 0.0
    # No offline job: nothing to count per.
    assert restarts_per_job_hour(_run(3600.0, 0, 0)) is None
