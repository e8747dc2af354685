"""The daemon's adoption scan: real processes read from /proc, rules from a config and from jobs."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.daemon_helpers import wait_for
from gpushare import config, protocol
from gpushare.control.adoption import Rule
from gpushare.daemon.adopter import Adopter, check_adopt, config_rules, registration_rules
from gpushare.daemon.registry import Registration
from gpushare.model import ClientClass
from gpushare.node.procs.facts import process_facts


@pytest.fixture
def start() -> Iterator:
    started: list[subprocess.Popen[bytes]] = []

    def run(env: dict[str, str], argv: list[str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv or ["sleep", "60"], env={"PATH": os.environ["PATH"], **env})
        started.append(proc)
        return proc

    yield run
    for p in started:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait(timeout=5)


def _rules(toml: str, owner: int = 0) -> list[Rule]:
    return [Rule(spec, owner, "test.toml") for spec in config.loads(toml).adopt]


MARKER = '[[adopt]]\nname = "m"\nmarker = true\n'


def _scan(pids, rules, *, min_age_s: float = 0.0, clients=(), **kw):
    adopter = Adopter(min_age_s=min_age_s, all_pids=lambda: sorted(pids))
    return adopter, adopter.scan(rules, clients=clients, gpu_pids=None, **kw)


def test_a_marked_process_is_adopted_in_its_class_once_it_is_old_enough(start):
    p = start({"GPUSHARE_CLASS": "offline"})
    plain = start({})
    adopter, young = _scan([p.pid, plain.pid], _rules(MARKER), min_age_s=3600)
    assert (young.adopt, young.young) == ((), 2)
    adopter.min_age_s = 0.0
    out = adopter.scan(_rules(MARKER), clients=(), gpu_pids=None)
    (found,) = out.adopt
    assert (found.facts.pid, found.decision.cls, found.source) == (
        p.pid, ClientClass.OFFLINE, "rule 'm' (test.toml)",
    )  # fmt: skip
    # Started without gpushare env: MPS does not limit it, and the message says how to fix it.
    assert any("started without CUDA_MPS_PIPE_DIRECTORY" in n for n in found.decision.notes)
    assert out.refused == out.idle == ()
    # Once it is a client, it (and anything it starts) is not adopted again.
    again = adopter.scan(_rules(MARKER), clients=[p.pid], gpu_pids=None)
    assert again.adopt == () and again.refused == again.idle == ()


def test_a_bad_marker_is_refused_once_with_the_fix(start):
    p = start({"GPUSHARE_CLASS": "batch"})
    adopter, out = _scan([p.pid], _rules(MARKER))
    assert out.adopt == ()
    assert out.refused == (
        f"pid {p.pid} (sleep) of root not adopted: GPUSHARE_CLASS='batch' is not a class: use "
        "online or offline",
    )
    assert adopter.scan(_rules(MARKER), clients=(), gpu_pids=None).refused == ()


def test_a_rule_that_matches_nothing_is_reported_once(start):
    rules = _rules('[[adopt]]\nname = "triton"\nunit = "triton.service"\nclass = "online"\n')
    adopter, out = _scan([start({}).pid], rules)
    assert out.idle == ("rule 'triton' (test.toml) matches no process: unit 'triton.service'",)
    assert adopter.scan(rules, clients=(), gpu_pids=None).idle == ()


def test_another_users_process_needs_its_owners_marker_or_roots_rule(start):
    p = start({})
    toml = f'[[adopt]]\nname = "u"\nuser = "{os.getuid()}"\nclass = "offline"\n'
    _, refused = _scan([p.pid], _rules(toml, owner=4242))
    assert refused.adopt == ()
    assert re.fullmatch(
        rf"rule 'u' \(test.toml, uid 4242\) would adopt pid {p.pid} \(sleep\) of root as offline, "
        r"which its owner did not ask for \(no GPUSHARE_CLASS in its environment\); only a rule in "
        r"root's config may do that",
        refused.refused[0],
    )
    _, by_root = _scan([p.pid], _rules(toml, owner=0))
    assert [f.facts.pid for f in by_root.adopt] == [p.pid]
    # Asked for by its owner: any rule may adopt it in that class.
    asked = start({"GPUSHARE_CLASS": "offline"})
    _, out = _scan([asked.pid], _rules(toml, owner=4242))
    assert [f.facts.pid for f in out.adopt] == [asked.pid]


def test_children_of_an_adopted_process_or_of_a_client_are_not_clients_of_their_own(start):
    parent = start({"GPUSHARE_CLASS": "online"}, ["sh", "-c", "sleep 60 & wait"])
    kid = wait_for(lambda: _children(parent.pid), what="the child")[0]
    _, out = _scan([parent.pid, kid], _rules(MARKER))
    assert [f.facts.pid for f in out.adopt] == [parent.pid]
    _, out = _scan([parent.pid, kid], _rules(MARKER), clients=[parent.pid])
    assert out.adopt == ()


def test_a_process_gone_before_it_is_read_is_skipped(start):
    p = start({"GPUSHARE_CLASS": "offline"}, ["true"])
    p.wait(timeout=5)
    _, out = _scan([p.pid], _rules(MARKER))
    assert out.adopt == () and out.young == 0


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


# ---------------------------------------------------------------------------------- jobs


def _reg(**params) -> Registration:
    base = {"source": "slurm", "job": "42", "uid": os.getuid(), "cls": "offline",
            "match_env": {"SLURM_JOB_ID": "42"}}  # fmt: skip
    base.update(params)
    return Registration("slurm", "42", 0, base, 0.0)


def test_a_registered_job_adopts_its_processes_and_no_others(start):
    mine = start({"SLURM_JOB_ID": "42"})
    other = start({"SLURM_JOB_ID": "43"})
    rules = registration_rules(_reg(sm_pct=30.0))
    _, out = _scan([mine.pid, other.pid], rules)
    (found,) = out.adopt
    assert (found.facts.pid, found.source, found.decision.cls) == (
        mine.pid, "slurm job 42", ClientClass.OFFLINE,
    )  # fmt: skip
    assert found.decision.sm_pct == 30.0
    # Explicit pids are adopted without the job's variables.
    bare = start({})
    _, out = _scan([bare.pid], registration_rules(_reg(match_env={}, pids=[bare.pid])))
    assert [f.facts.pid for f in out.adopt] == [bare.pid]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"cls": "batch"}, "class 'batch' is not a class: use online or offline"),
        ({"match_env": {}}, "give match_env (e.g. SLURM_JOB_ID=<job>) or pids"),
        ({"sm_pct": 150.0}, "--sm must be a percentage in (0, 100], got 150"),
        ({"cls": "offline", "slo_p99_ms": 40.0}, "--slo-p99 applies to --online workloads only"),
        ({"job": " "}, "source and job must name the scheduler and its job"),
    ],
)
def test_a_bad_adopt_request_is_refused_with_the_fix(params, message):
    req = protocol.from_params(protocol.AdoptRequest, {**_reg().params, **params})
    with pytest.raises(ValueError, match=re.escape(message)):
        check_adopt(req, 0)


def test_only_root_registers_another_users_job():
    req = protocol.from_params(protocol.AdoptRequest, {**_reg().params, "uid": 1000})
    assert check_adopt(req, 0) == (ClientClass.OFFLINE, None)
    assert check_adopt(req, 1000) == (ClientClass.OFFLINE, None)
    cls, denied = check_adopt(req, 1001)
    assert denied is not None and denied.startswith("uid 1001 may register its own processes only")


def test_config_rules_stand_on_the_config_files_owner(tmp_path: Path):
    f = tmp_path / "g.toml"
    f.write_text(MARKER)
    cfg = config.load(f)
    assert [(r.owner_uid, r.source) for r in config_rules(cfg, f)] == [(0, str(f))]
    if os.geteuid() == 0:
        os.chown(f, 1000, 1000)
        assert config_rules(cfg, f)[0].owner_uid == 1000
    assert config_rules(config.Config(), None)[0].source == "the built-in default"
    assert sys.platform.startswith("linux")


def test_an_idle_rule_says_when_environments_cannot_be_read(start):
    p = start({})
    real = process_facts

    def unreadable(pid, names, gpu_pids=None):
        f = real(pid, names, gpu_pids)
        return None if f is None else dataclasses.replace(f, environ=None)

    adopter = Adopter(min_age_s=0.0, all_pids=lambda: [p.pid], facts_of=unreadable)
    out = adopter.scan(_rules(MARKER), clients=(), gpu_pids=None)
    assert out.idle == (
        "rule 'm' (test.toml) matches no process: marker; the environment of 1 process(es) of "
        "other users cannot be read (run the daemon as root)",
    )
