"""The adoption scan's cache of process facts: what it reads again, and when (gpushare.daemon.factcache)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from bench.support.daemon_helpers import wait_for
from gpushare import config
from gpushare.control.adoption import Rule
from gpushare.daemon.adopter import Adopter
from gpushare.daemon.factcache import FactCache
from gpushare.model import ProcessFacts
from gpushare.node.procs.facts import Stamp, process_facts, process_stamp, read_environ
from gpushare.node.procs.identity import process_identity

PID = 4242


def _facts(start_time: float = 100.0, **kw) -> ProcessFacts:
    base = ProcessFacts(
        pid=PID, ppid=1, uid=1000, user="u", name="job", start_time=start_time,
        cgroup="/a.slice", unit="a.slice", environ={}, gpu_uuids=None,
    )  # fmt: skip
    return dataclasses.replace(base, **kw)


class FakeProc:
    """One pid whose process the test replaces; counts full reads and owner reads."""

    def __init__(self) -> None:
        self.facts = _facts()
        self.image = (100, 1, 2)
        self.full_reads = 0
        self.owner_reads = 0

    def facts_of(self, pid, names, gpu_pids=None):
        self.full_reads += 1
        return self.facts

    def stamp_of(self, pid):
        return Stamp(self.facts.name, self.facts.ppid, "S", False, self.image)

    def owner_of(self, pid):
        self.owner_reads += 1
        return self.facts.uid, self.facts.cgroup

    def cache(self, refresh_s: float = 30.0, verify_s: float = 0.0) -> FactCache:
        return FactCache(
            facts_of=self.facts_of, stamp_of=self.stamp_of, owner_of=self.owner_of,
            refresh_s=refresh_s, verify_s=verify_s,
        )  # fmt: skip


def _read(cache: FactCache, now: float = 200.0) -> list[ProcessFacts]:
    facts, _ = cache.read([PID], {"GPUSHARE_CLASS"}, None, now=now, min_age_s=1.0)
    return facts


def test_a_reused_pid_is_read_again_not_served_from_the_cache():
    p = FakeProc()
    cache = p.cache()
    assert _read(cache) == [p.facts] and p.full_reads == 1
    assert _read(cache, now=201) == [p.facts] and p.full_reads == 1  # the same process: cached
    # Another process with the same pid: another start time (in ticks and in seconds).
    p.facts = _facts(start_time=150.0, uid=0, name="other", environ={"GPUSHARE_CLASS": "online"})
    p.image = (150, 1, 2)
    assert _read(cache, now=202) == [p.facts] and p.full_reads == 2
    # An exec: same start time and name, the environment laid out elsewhere.
    p.facts = dataclasses.replace(p.facts, environ={"GPUSHARE_CLASS": "offline"})
    p.image = (150, 7, 8)
    assert _read(cache, now=203) == [p.facts] and p.full_reads == 3


def test_uid_and_cgroup_changes_are_seen_after_the_refresh_period():
    p = FakeProc()
    cache = p.cache(refresh_s=30.0)
    first = p.facts
    _read(cache, now=200)
    p.facts = _facts(cgroup="/b.slice/job.service")
    assert _read(cache, now=229) == [first] and p.owner_reads == 0  # within the period: cached
    (moved,) = _read(cache, now=230)
    assert (moved.cgroup, moved.unit, p.owner_reads, p.full_reads) == (
        "/b.slice/job.service", "job.service", 1, 1,
    )  # fmt: skip
    # A changed uid reads the process in full again (its environment's readability changes).
    p.facts = _facts(cgroup="/b.slice/job.service", uid=0, user="root")
    assert _read(cache, now=259) == [moved]
    assert _read(cache, now=260) == [p.facts] and p.full_reads == 2


def test_young_processes_are_not_cached_and_gone_ones_are_dropped():
    p = FakeProc()
    cache = p.cache()
    _read(cache, now=100.5)  # half a second old: read again next time
    _read(cache, now=100.6)
    assert (p.full_reads, len(cache)) == (2, 0)
    _read(cache, now=102)
    assert len(cache) == 1
    facts, changed = cache.read([], {"GPUSHARE_CLASS"}, None, now=103, min_age_s=1.0)
    assert (facts, changed, len(cache)) == ([], True, 0)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs_: list[subprocess.Popen[bytes]] = []
    yield procs_
    for p in procs_:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait(timeout=5)


def test_a_steady_state_scan_reads_no_environment_of_known_processes(started):
    env = {"PATH": os.environ["PATH"]}
    marked = subprocess.Popen(["sleep", "60"], env={**env, "GPUSHARE_CLASS": "offline"})
    plain = subprocess.Popen(["sleep", "60"], env=env)
    started += [marked, plain]
    environ_reads: list[int] = []

    def counting(pid, names, gpu_pids=None):
        environ_reads.append(pid)  # every full read reads /proc/<pid>/environ
        return process_facts(pid, names, gpu_pids)

    for p in started:  # the arguments are laid out once exec is done (tests/daemon/test_adopter.py)
        wait_for(lambda p=p: process_identity(p.pid) not in (None, (0, [])), what="exec")
    pids = [marked.pid, plain.pid]
    adopter = Adopter(min_age_s=0.0, all_pids=lambda: pids, facts_of=counting)
    rules = [Rule(s, 0, "t.toml") for s in config.loads('[[adopt]]\nname="m"\nmarker=true').adopt]
    first = adopter.scan(rules, clients=(), gpu_pids=None)
    assert sorted(environ_reads) == sorted(pids)
    environ_reads.clear()
    again = adopter.scan(rules, clients=(), gpu_pids=None)
    assert environ_reads == []
    assert [f.facts.pid for f in again.adopt] == [f.facts.pid for f in first.adopt] == [marked.pid]
    # An input of the decision changed (the marked process is a client now): decided again.
    assert adopter.scan(rules, clients=[marked.pid], gpu_pids=None).adopt == ()
    assert environ_reads == []


def test_an_exec_moves_the_environment_so_the_stamp_changes(started):
    code = (
        "import os, sys; sys.stdin.readline(); "
        "os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)'], "
        "{'GPUSHARE_CLASS': 'offline'})"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], env={"PATH": os.environ["PATH"]}, stdin=subprocess.PIPE
    )
    started.append(p)
    wait_for(lambda: process_identity(p.pid) not in (None, (0, [])), what="exec")
    before = process_stamp(p.pid)
    cache = FactCache(verify_s=0.0)  # the stamp at every read: what it tells is the point here
    (f,), _ = cache.read([p.pid], {"GPUSHARE_CLASS"}, None, now=time.time(), min_age_s=0.0)
    assert f.environ == {}
    assert p.stdin is not None
    p.stdin.write(b"go\n")
    p.stdin.close()
    wait_for(lambda: read_environ(p.pid, {"GPUSHARE_CLASS"}), what="the exec")
    after = process_stamp(p.pid)
    assert before is not None and after is not None
    assert before.name == after.name  # the same executable: only the environment's address tells
    assert before.image[0] == after.image[0] and before.image != after.image
    (f,), changed = cache.read([p.pid], {"GPUSHARE_CLASS"}, None, now=time.time(), min_age_s=0.0)
    assert (f.environ, changed) == ({"GPUSHARE_CLASS": "offline"}, True)


def test_a_known_process_is_checked_again_within_the_verify_period_new_ones_at_once():
    p = FakeProc()
    cache = p.cache(verify_s=10.0)
    assert _read(cache, now=200) == [p.facts] and cache.stamp_reads == 1
    first = p.facts
    # An exec (another image, another environment) within the period: served from the cache,
    # its stat not read, for at most 1.5 verify periods.
    p.facts = dataclasses.replace(p.facts, environ={"GPUSHARE_CLASS": "offline"})
    p.image = (100, 7, 8)
    for now in (202, 204):
        assert _read(cache, now=now) == [first]
    assert cache.stamp_reads == 1
    assert _read(cache, now=215.1) == [p.facts]
    assert (cache.stamp_reads, p.full_reads) == (2, 2)
    # A new pid is read at the first scan that sees it, whatever the period.
    facts, changed = cache.read([PID, PID + 1], {"GPUSHARE_CLASS"}, None, now=216, min_age_s=1.0)
    assert changed and len(facts) == 2 and p.full_reads == 3


def test_a_recent_process_is_checked_at_every_scan():
    # Forked by slurmstepd, which runs the TaskProlog before the fork execs the job's script:
    # the exec must be seen before the script's children are decided.
    p = FakeProc()
    cache = p.cache(verify_s=10.0)
    _read(cache, now=130)  # 30 s old
    p.facts = dataclasses.replace(p.facts, name="bash", environ={"GPUSHARE_CLASS": "offline"})
    p.image = (100, 7, 8)
    assert _read(cache, now=132) == [p.facts]
    assert (cache.stamp_reads, p.full_reads) == (2, 2)


def test_a_client_is_not_looked_at_again_while_it_is_one():
    p = FakeProc()
    cache = p.cache(verify_s=0.0)  # every other process: its stat at every read
    _read(cache, now=130)
    for now in (132, 134, 160):
        facts, _ = cache.read(
            [PID], {"GPUSHARE_CLASS"}, None, now=now, min_age_s=1.0, clients={PID}
        )
        assert facts == [p.facts]
    assert cache.stamp_reads == 1
    assert _read(cache, now=162) == [p.facts] and cache.stamp_reads == 2  # no longer a client


def test_a_process_that_comes_onto_a_gpu_is_checked_at_once():
    p = FakeProc()
    cache = p.cache(verify_s=10.0)
    _read(cache, now=200)
    # It execs into a CUDA program, which NVML then lists on a GPU: looked at again at once.
    p.facts = dataclasses.replace(p.facts, environ={"GPUSHARE_CLASS": "offline"})
    p.image = (100, 7, 8)
    (f,), changed = cache.read([PID], {"GPUSHARE_CLASS"}, {PID: ("GPU-0",)}, now=201, min_age_s=1.0)
    assert changed and f.environ == {"GPUSHARE_CLASS": "offline"} and f.gpu_uuids == ("GPU-0",)
    assert cache.stamp_reads == 2


def test_a_changed_gpu_process_list_decides_again():
    p = FakeProc()
    p.facts = _facts(environ={"GPUSHARE_CLASS": "offline"})
    adopter = Adopter(min_age_s=1.0, all_pids=lambda: [PID], clock=lambda: 200.0, cache=p.cache())
    toml = '[[adopt]]\nname = "m"\nmarker = true\nuses_gpu = true\n'
    rules = [Rule(s, 0, "t.toml") for s in config.loads(toml).adopt]
    assert adopter.scan(rules, clients=(), gpu_pids={}).adopt == ()
    assert adopter.scan(rules, clients=(), gpu_pids={}).adopt == ()
    (found,) = adopter.scan(rules, clients=(), gpu_pids={PID: ("GPU-0",)}).adopt
    assert (found.facts.pid, found.facts.gpu_uuids, p.full_reads) == (PID, ("GPU-0",), 1)
