"""End to end: a real daemon runs the gpushare controller and applies its actions for real.

A real daemon process (``tests/support/daemon_proc.py``: its run loop, socket, SQLite, the cgroup v2
freezer or the signal fallback, the ``gpushare`` policy) drives a fake GPU whose probe latency
responds to what the daemon actually does to the offline clients: while the test's online burst
is on, the latency grows with the CPU time the offline processes really consumed
(``tests/fakes/fake_dutyprobe.py``). Clients are submitted through the real CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason
from bench.support.daemon_helpers import REPO, DaemonProc, duty_gpu_daemon, wait_for
from gpushare import config
from gpushare.node.procs.identity import is_same_process, process_start_time
from tests.fakes.fake_dutyprobe import cpu_ns
from tests.fakes.fake_gpu import GIB, fake_uuid

PERIOD = "50ms"
BUSY = "while True: pass"
IDLE = "import time\nwhile True: time.sleep(0.005)"
# Busy, and exits cleanly on its checkpoint signal (SIGUSR1), as a restartable job should.
CHECKPOINTING = "import signal, sys\nsignal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))\n" + BUSY


class E2e:
    """A daemon with the duty-responsive fake GPU, and the CLI to talk to it."""

    def __init__(self, dp: DaemonProc, state_dir: Path) -> None:
        self.dp = dp
        self.state_dir = state_dir
        self.foreground: list[subprocess.Popen[bytes]] = []

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "gpushare", *args, "--socket", str(self.dp.socket)]
            if args[0] != "submit"
            else [
                sys.executable,
                "-m",
                "gpushare",
                "submit",
                "--socket",
                str(self.dp.socket),
                *args[1:],
            ],  # fmt: skip
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, f"gpushare {' '.join(args)}: {out.stderr}"
        return out.stdout

    def submit_offline(self, *opts: str, code: str = BUSY) -> str:
        out = self.cli("submit", "--offline", "--detach", "--gpu", "0", *opts,
                       "--", sys.executable, "-c", code)  # fmt: skip
        return out.split()[0]

    def submit_online(self, slo: str) -> str:
        """A foreground online client: the CLI execs the workload, as a user would run it."""
        before = {c["id"] for c in self.dp.call("list", {"all": True})["clients"]}
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpushare", "submit", "--socket", str(self.dp.socket),
             "--online", "--slo-p99", slo, "--gpu", "0", "--", sys.executable, "-c", IDLE],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.foreground.append(proc)

        def new_running() -> str | None:
            for c in self.dp.call("list", {"all": True})["clients"]:
                if c["id"] not in before and c["state"] == "running" and c["pid"] == proc.pid:
                    return str(c["id"])
            return None

        return str(wait_for(new_running, 15.0, "the online client to run"))

    def duty(self) -> float:
        return float(self.dp.call("status")["gpus"][0]["duty"])

    def pid(self, client_id: str) -> int:
        pid = self.dp.client(client_id)["pid"]
        assert pid is not None
        return int(pid)

    def cpu_s(self, pids: list[int], seconds: float) -> float:
        """CPU seconds the processes consume over the next ``seconds``."""
        before = [cpu_ns(p) for p in pids]
        time.sleep(seconds)
        after = [cpu_ns(p) for p in pids]
        assert None not in before and None not in after, "a client process vanished"
        return sum(a - b for a, b in zip(after, before, strict=True)) / 1e9  # type: ignore[operator]

    def burst(self, on: bool) -> None:
        flag = self.state_dir / "burst"
        if on:
            flag.touch()
        else:
            flag.unlink()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.cli("events", "--json").splitlines()]

    def close(self) -> None:
        for proc in self.foreground:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        self.dp.cleanup()


def _start(pauser: str, extra: str = "") -> E2e:
    if pauser == "cgroup" and (reason := cgroup_skip_reason()) is not None:
        pytest.skip(reason)
    dp, state_dir = duty_gpu_daemon(f'[control]\nperiod = "{PERIOD}"\n{extra}', pauser)
    e2e = E2e(dp, state_dir)
    try:
        dp.start()
        status = dp.call("status")
        assert status["daemon"]["policy"] == "gpushare"
        assert status["daemon"]["pause_mechanism"] == pauser
    except BaseException:
        e2e.close()
        raise
    return e2e


@pytest.fixture(params=["cgroup", "signal"])
def e2e(request: pytest.FixtureRequest) -> Iterator[E2e]:
    env = _start(request.param)
    try:
        yield env
    finally:
        env.close()


def test_online_burst_throttles_offline_work_and_releases_it(e2e: E2e) -> None:
    online = e2e.submit_online("40ms")
    offline = [e2e.submit_offline(), e2e.submit_offline()]
    off_pids = [e2e.pid(c) for c in offline]
    on_pid = e2e.pid(online)

    # No burst: the SLO holds, offline work runs free.
    wait_for(lambda: e2e.duty() == 1.0, 5.0, "duty 1 with the SLO met")
    free_s = e2e.cpu_s(off_pids, 1.0)
    assert free_s > 0.2, f"offline clients used only {free_s:.3f} CPU-s in 1 s while free"

    # Burst: offline CPU time now hurts the online latency; the controller must cut it.
    e2e.burst(True)
    wait_for(lambda: e2e.duty() <= 0.05, 5.0, "the duty to fall under the burst")
    on_before = cpu_ns(on_pid)
    burst_s = e2e.cpu_s(off_pids, 1.0)
    on_after = cpu_ns(on_pid)
    assert (
        burst_s < 0.25 * free_s
    ), f"offline clients still used {burst_s:.3f} CPU-s/s under the burst ({free_s:.3f} free)"
    assert (
        on_before is not None and on_after is not None and on_after > on_before
    ), "the online client made no progress during the burst: it was frozen"
    mid = {c["id"]: c for c in e2e.dp.call("list")["clients"]}
    assert mid[online]["state"] == "running" and not mid[online]["held"]
    for c in offline:
        assert mid[c]["state"] == "throttled", mid[c]
    # What the fake GPU saw: the probe was over its SLO at some point, so the loop had a reason.
    trace = [json.loads(line) for line in (e2e.state_dir / "trace.jsonl").read_text().splitlines()]
    assert max(t["ratio"] for t in trace) > 1.5

    # Burst over: the duty climbs back to 1 and offline work resumes.
    e2e.burst(False)
    # How long the climb takes depends on the duty of the last breach under the burst: steps
    # above half of it wait slow_increase_after_ticks (30 x 50 ms) each. From a breach at 1 the
    # climb takes 10 fast + 10 slow steps, 16.5 s; the bound leaves room for a loaded machine.
    wait_for(lambda: e2e.duty() == 1.0, 30.0, "the duty to climb back to 1")
    after_s = e2e.cpu_s(off_pids, 1.0)
    assert (
        after_s > 0.3 * free_s and after_s > 4 * burst_s
    ), f"offline work did not resume: {after_s:.3f} CPU-s in 1 s ({free_s:.3f} before the burst)"
    print(f"offline CPU-s/s: free {free_s:.3f}, burst {burst_s:.3f}, after {after_s:.3f}")
    after = {c["id"]: c for c in e2e.dp.call("list")["clients"]}
    assert all(after[c]["state"] == "running" for c in offline)

    # The events say what the controller did and why; none touched the online client.
    events = e2e.events()
    duty_events = [e for e in events if e["kind"] in ("offline_throttled", "offline_duty")]
    assert duty_events, "no duty event in gpushare events"
    assert any("SLO" in e["message"] for e in duty_events), duty_events
    assert any(e["kind"] == "offline_released" for e in events)
    throttled = {
        e["client_id"] for e in events if e["kind"] in ("client_throttled", "client_frozen")
    }
    assert set(offline) <= throttled
    assert online not in throttled
    reasons = [e["message"] for e in events if e["kind"] == "client_throttled"]
    assert all("duty" in m for m in reasons), reasons


def test_memory_pressure_evicts_a_restartable_offline_client_and_requeues_it() -> None:
    e2e = _start("cgroup" if cgroup_skip_reason() is None else "signal",
                 'evict_grace = "300ms"\n')  # fmt: skip
    try:
        small = e2e.submit_offline("--restartable", "--mem", "2G")
        large = e2e.submit_offline("--mem", "3G")
        old_pid = e2e.pid(small)
        start_time = process_start_time(old_pid)
        assert start_time is not None
        # Readings are as of the last tick, and a submit takes a tenth of a second: wait for one.
        free = 16 * GIB - 1 * GIB - 5 * GIB
        wait_for(lambda: e2e.dp.call("status")["gpus"][0]["mem_free_bytes"] == free, 10.0,
                 "a tick to read both clients' memory")  # fmt: skip

        # The online side grows: 1 GiB free, under the 2 GiB reserve. The restartable client
        # goes first though the other is larger, and one eviction restores the reserve.
        (e2e.state_dir / "mem_used").write_text(str(10 * GIB))
        wait_for(lambda: e2e.dp.client(small)["state"] == "queued", 10.0, "the eviction")
        assert not is_same_process(old_pid, start_time), "the evicted process still runs"
        events = e2e.events()
        evicting = [e for e in events if e["kind"] == "client_evicting"]
        assert [e["client_id"] for e in evicting] == [small]
        assert "reserve" in evicting[0]["message"], evicting[0]
        # It waits in the queue while its memory does not fit beside the reserve.
        time.sleep(0.5)
        assert e2e.dp.client(small)["state"] == "queued"
        assert e2e.dp.client(large)["state"] == "running"

        # Memory comes back: admission starts it again, in a new process.
        (e2e.state_dir / "mem_used").write_text(str(1 * GIB))
        wait_for(lambda: e2e.dp.client(small)["state"] == "running", 10.0, "the readmission")
        assert e2e.pid(small) != old_pid
        assert e2e.dp.client(large)["state"] == "running"
    finally:
        e2e.close()


def test_measured_online_demand_lowers_the_share_and_restarts_a_restartable_client() -> None:
    """The slow lever: SetOfflineShare, then RestartClient through the checkpoint signal."""
    # A restart that costs 1 s (issue 32): with the duty at 0 the cut pays once it has held 1 s.
    e2e = _start("cgroup" if cgroup_skip_reason() is None else "signal",
                 'share_min_interval = "1s"\nrestart_cost = "1s"\n')  # fmt: skip
    try:
        # Online demand starts low, and the job is submitted first: it is launched under the
        # share of a GPU with no online demand however long the CLI takes on a loaded machine.
        (e2e.state_dir / "sm_active").write_text("0")
        job = e2e.submit_offline("--restartable", code=CHECKPOINTING)
        online = e2e.submit_online("40ms")
        first = e2e.dp.client(job)
        before = first["sm_pct"]
        assert before >= 80.0
        old_pid = first["pid"]

        # The online side now uses 70 % of the SMs; the burst freezes offline work and quiet
        # ticks measure that demand: the share comes down and the job is checkpointed and
        # relaunched under it.
        (e2e.state_dir / "sm_active").write_text("70")
        e2e.burst(True)

        def relaunched() -> dict[str, Any] | None:
            c = e2e.dp.client(job)
            return c if c["restarts"] >= 1 and c["state"] in ("running", "throttled") else None

        now = wait_for(relaunched, 10.0, "the restart under the new share")
        e2e.burst(False)
        share = e2e.dp.call("status")["gpus"][0]["offline_sm_pct"]
        # What the SLO leaves: with offline work quiet the probe is back at its baseline, 1/1.5
        # of its SLO, so online work may need 67 % of the SMs (the share follows the SLO's
        # latency bound; SM demand, 100 - 70 - 10 headroom, is its fallback).
        assert share <= 33.0 < before
        assert now["sm_pct"] == share and now["pid"] != old_pid
        env = Path(f"/proc/{now['pid']}/environ").read_bytes().split(b"\0")
        assert f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={share:g}".encode() in env
        events = e2e.events()
        changed = [e for e in events if e["kind"] == "offline_share_changed"]
        assert changed and "its SLO with offline quiet" in changed[-1]["message"], changed
        restarting = [e for e in events if e["kind"] == "client_restarting"]
        assert [e["client_id"] for e in restarting] == [job]
        assert "checkpoint and relaunch" in restarting[0]["message"]
        assert e2e.dp.client(online)["restarts"] == 0
    finally:
        e2e.close()


def test_mps_fault_recovers_with_offline_clients_removed_first() -> None:
    """RecoverMps: offline clients go (restartable requeued), online kept, admission waits."""
    e2e = _start("cgroup" if cgroup_skip_reason() is None else "signal",
                 'evict_grace = "300ms"\n')  # fmt: skip
    try:
        online = e2e.submit_online("40ms")
        job = e2e.submit_offline("--restartable")
        other = e2e.submit_offline()
        old_pid = e2e.pid(job)
        cfg = config.load(e2e.dp.config_path)
        state_file = cfg.paths.resolved("mps_pipe_dir") / f"{fake_uuid(0)}.state"
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text("fault")

        wait_for(lambda: e2e.dp.client(other)["state"] == "failed", 10.0, "the offline removal")
        wait_for(lambda: e2e.dp.client(job)["state"] == "queued", 10.0, "the requeue")
        assert "MPS recovery" in (e2e.dp.client(other)["reason"] or "")
        events = e2e.events()
        recovery = [e for e in events if e["kind"] == "mps_recovery"]
        assert recovery and "FAULT" in recovery[0]["message"]
        assert any(e["kind"] == "alert" and e["severity"] == "critical" for e in events)
        assert e2e.dp.client(online)["state"] == "running"
        # Admission waits while MPS is not up.
        time.sleep(0.3)
        assert e2e.dp.client(job)["state"] == "queued"

        state_file.write_text("up")
        wait_for(lambda: e2e.dp.client(job)["state"] == "running", 10.0, "the readmission")
        assert e2e.pid(job) != old_pid
        events = e2e.events()
        assert any(
            e["kind"] == "alert" and e["message"].startswith("MPS recovered") for e in events
        )
        assert e2e.dp.client(online)["state"] == "running"
    finally:
        e2e.close()
