"""Adoption rules: ``[[adopt]]`` in the config, and the pure matcher over process facts."""

import dataclasses

import pytest

from gpushare import config
from gpushare.config import AdoptRule, ConfigError
from gpushare.control.adoption import Rule, decide, read_marker, scan
from gpushare.model import ClientClass, ProcessFacts

ROOT_CFG = "/etc/gpushare/gpushare.toml"
GPU = "GPU-8a2f1c3e-1111-2222-3333-444455556666"


def facts(pid: int = 100, **kw) -> ProcessFacts:
    base = {
        "pid": pid, "ppid": 1, "uid": 1000, "user": "alice", "name": "python", "start_time": 1.0,
        "cgroup": "/user.slice/user-1000.slice/session-3.scope", "unit": "session-3.scope",
        "environ": {}, "gpu_uuids": None,
    }  # fmt: skip
    base.update(kw)
    return ProcessFacts(**base)


def rule(owner_uid: int = 0, source: str = ROOT_CFG, **kw) -> Rule:
    return Rule(AdoptRule(**{"name": "r", **kw}), owner_uid, source)


MARKER = Rule(config.MARKER_RULE, 0, ROOT_CFG)
MPS_ENV = {
    "CUDA_MPS_PIPE_DIRECTORY": f"/run/gpushare/mps/{GPU}",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{GPU}=8G",
}


# ----------------------------------------------------------------------------------- the matcher


def test_the_default_rule_adopts_a_process_in_the_class_it_declares():
    env = {"GPUSHARE_CLASS": "online", "GPUSHARE_SLO_P99": "40ms", **MPS_ENV}
    d = decide([MARKER], facts(environ=env, gpu_uuids=(GPU,)))
    assert d.adopt and d.rule == "marker"
    assert d.cls is ClientClass.ONLINE
    assert d.slo_p99_s == pytest.approx(0.04)
    assert (d.sm_pct, d.mem_bytes, d.gpu_uuid) == (30.0, 8 << 30, GPU)
    assert d.notes == ()
    assert d.reason == f"rule 'marker' ({ROOT_CFG}): online, SLO p99 40ms"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"GPUSHARE_CLASS": "batch"},
            "GPUSHARE_CLASS='batch' is not a class: use online or offline",
        ),
        ({"GPUSHARE_CLASS": ""}, "GPUSHARE_CLASS='' is not a class"),
        (
            {"GPUSHARE_CLASS": "online", "GPUSHARE_SLO_P99": "fast"},
            "GPUSHARE_SLO_P99='fast': expected a duration such as 50ms",
        ),
        (
            {"GPUSHARE_CLASS": "offline", "GPUSHARE_SLO_P99": "40ms"},
            "GPUSHARE_SLO_P99='40ms': --slo-p99 applies to --online workloads only",
        ),
    ],
)
def test_a_marker_with_a_bad_value_is_not_adopted_and_says_why(env, message):
    d = decide([MARKER], facts(environ=env, gpu_uuids=(GPU,)))
    assert not d.adopt and d.rule == "marker"
    assert d.reason.startswith("pid 100 (python) of alice not adopted: ")
    assert message in d.reason


def test_a_process_without_marker_matches_no_rule():
    d = decide([MARKER], facts(environ={"PATH": "/usr/bin"}, gpu_uuids=(GPU,)))
    assert (d.adopt, d.rule, d.reason) == (False, None, "no rule matches")


def test_the_default_rule_leaves_a_marked_process_alone_until_it_uses_a_gpu():
    # A shell that exported the marker to start its job: freezing it would freeze a terminal.
    shell = facts(environ={"GPUSHARE_CLASS": "offline"}, name="bash")
    assert decide([MARKER], shell).rule is None
    assert decide([MARKER], dataclasses.replace(shell, gpu_uuids=None)).rule is None
    assert decide([MARKER], dataclasses.replace(shell, gpu_uuids=(GPU,))).adopt


def test_a_root_rule_adopts_another_users_unit_and_says_mps_does_not_limit_it():
    r = rule(unit="triton*.service", cls="online", slo_p99_s=0.05)
    d = decide([r], facts(unit="triton-a.service", cgroup="/system.slice/triton-a.service"))
    assert d.adopt and d.cls is ClientClass.ONLINE and d.slo_p99_s == 0.05
    assert any(
        "started without CUDA_MPS_PIPE_DIRECTORY: MPS does not limit it" in n for n in d.notes
    )


def test_a_users_rule_may_not_adopt_another_users_process_into_an_undeclared_class():
    r = rule(owner_uid=1001, source="slurm job 7", user="alice", cls="offline")
    d = decide([r], facts())
    assert not d.adopt
    assert d.reason == (
        "rule 'r' (slurm job 7, uid 1001) would adopt pid 100 (python) of alice as offline, which "
        "its owner did not ask for (no GPUSHARE_CLASS in its environment); only a rule in root's "
        "config may do that"
    )
    asked_other = decide([r], facts(environ={"GPUSHARE_CLASS": "online"}))
    assert not asked_other.adopt
    assert "(GPUSHARE_CLASS=online in its environment)" in asked_other.reason
    asked = decide([r], facts(environ={"GPUSHARE_CLASS": "offline"}))
    assert asked.adopt and asked.cls is ClientClass.OFFLINE


def test_a_users_rule_adopts_the_users_own_processes():
    r = rule(owner_uid=1000, source="~/.config", user="alice", cls="offline")
    assert decide([r], facts()).adopt


def test_a_root_rule_may_override_the_declared_class_and_says_so():
    r = rule(cgroup="/user.slice/*", cls="offline")
    d = decide([r], facts(environ={"GPUSHARE_CLASS": "online"}))
    assert d.adopt and d.cls is ClientClass.OFFLINE
    assert (
        f"its owner asked for online (GPUSHARE_CLASS); rule 'r' ({ROOT_CFG}) makes it offline"
        in d.notes
    )


def test_a_bad_marker_is_reported_but_ignored_when_the_rule_gives_the_class():
    r = rule(user="alice", cls="offline")
    d = decide([r], facts(environ={"GPUSHARE_CLASS": "batch", **MPS_ENV}))
    assert d.adopt and d.cls is ClientClass.OFFLINE
    assert d.notes == (
        "GPUSHARE_CLASS='batch' is not a class: use online or offline (ignored: rule 'r' gives the class)",
    )


def test_limits_the_process_runs_with_are_compared_with_the_rules():
    r = rule(user="alice", cls="offline", sm_pct=50.0, mem_bytes=4 << 30)
    d = decide([r], facts(environ=MPS_ENV))
    assert (d.sm_pct, d.mem_bytes) == (30.0, 8 << 30)
    assert any("runs with SM share 30%, rule 'r' expects 50%" in n for n in d.notes)
    assert any("runs with 8G pinned-memory limit, rule 'r' expects 4G" in n for n in d.notes)


def test_memory_limit_keyed_by_ordinal_and_gpu_from_nvml():
    env = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=512M"}
    d = decide([rule(user="alice", cls="offline")], facts(environ=env, gpu_uuids=(GPU,)))
    assert (d.mem_bytes, d.gpu_uuid) == (512 << 20, GPU)
    bad = decide([rule(user="alice", cls="offline")],
                 facts(environ={**env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "lots"}))  # fmt: skip
    assert any("is not <device>=<size>" in n for n in bad.notes)


def test_every_condition_must_hold_and_the_first_matching_rule_decides():
    p = facts(uid=0, user="root", environ={"SLURM_JOB_ID": "42"}, gpu_uuids=(GPU,))
    narrow = rule(
        name="narrow", user="root", env={"SLURM_JOB_ID": "4?"}, uses_gpu=True, cls="online"
    )
    broad = rule(name="broad", user="0", cls="offline")
    assert decide([narrow, broad], p).rule == "narrow"
    assert (
        decide(
            [
                dataclasses.replace(
                    narrow, spec=dataclasses.replace(narrow.spec, env={"SLURM_JOB_ID": "5*"})
                ),
                broad,
            ],
            p,
        ).rule
        == "broad"
    )
    no_gpu = rule(name="gpu", uses_gpu=True, cls="offline")
    assert decide([no_gpu], dataclasses.replace(p, gpu_uuids=())).rule is None
    assert decide([no_gpu], dataclasses.replace(p, gpu_uuids=None)).rule is None
    unreadable = dataclasses.replace(p, environ=None)
    assert decide([MARKER], unreadable).rule is None


def test_scan_folds_descendants_and_names_rules_that_matched_nothing():
    marked = {"GPUSHARE_CLASS": "offline", **MPS_ENV}
    procs = [
        facts(9, environ=marked, name="bash"),  # not a GPU process: not a client
        facts(10, ppid=9, environ=marked, gpu_uuids=(GPU,)),
        facts(11, ppid=10, environ=marked, name="worker"),
        facts(12, ppid=11, environ={}, name="helper"),
        facts(20, environ={"GPUSHARE_CLASS": "nonsense"}, gpu_uuids=(GPU,)),
        facts(30),
    ]
    idle = rule(name="triton", unit="triton.service", cls="online")
    gpu = rule(name="gpus", uses_gpu=True, cls="offline")
    result = scan([MARKER, idle, gpu], procs)
    assert [(d.pid, d.adopt) for d in result.decisions] == [(10, True), (20, False)]
    assert result.members == {10: 10, 11: 10, 12: 10}
    # 'gpus' would match pid 10 and 20, but the marker rule before it decided them.
    assert result.unmatched == (
        f"rule 'triton' ({ROOT_CFG}) matches no process: unit 'triton.service'",
        f"rule 'gpus' ({ROOT_CFG}) matches no process: uses_gpu",
    )
    no_nvml = scan([gpu], [facts(40)])
    assert no_nvml.unmatched == (
        f"rule 'gpus' ({ROOT_CFG}) matches no process: uses_gpu; NVML is not available here, "
        "so uses_gpu never holds",
    )


def test_read_marker():
    assert read_marker(None) is None
    assert read_marker({}) is None
    m = read_marker({"GPUSHARE_CLASS": " Offline "})
    assert m is not None and m.cls is ClientClass.OFFLINE and m.error is None


# ------------------------------------------------------------------------------- [[adopt]] config


def test_adopt_tables_load_validate_and_round_trip():
    cfg = config.loads(
        """
        [[adopt]]
        name = "triton"
        unit = "triton*.service"
        class = "online"
        slo_p99 = "40ms"
        sm_pct = 60
        mem = "20G"
        [[adopt]]
        env = { SLURM_JOB_ID = "*" }
        marker = true
        """
    )
    first, second = cfg.adopt
    assert (first.cls, first.slo_p99_s, first.sm_pct, first.mem_bytes) == (
        "online",
        0.04,
        60.0,
        20 << 30,
    )
    assert (second.name, second.cls, second.env) == ("adopt[1]", "marker", {"SLURM_JOB_ID": "*"})
    assert config.loads(config.to_toml(cfg)) == cfg
    none = config.loads("adopt = []")
    assert none.adopt == ()
    assert config.loads(config.to_toml(none)) == none


def test_the_default_is_the_marker_rule():
    assert config.Config().adopt == (config.MARKER_RULE,)


@pytest.mark.parametrize(
    ("text", "key", "hint"),
    [
        ("[[adopt]]\nclass = 'online'", "adopt[0]", "matches every process: give at least one of"),
        ("[[adopt]]\nunit = 'x.service'", "adopt[0].class", 'give class = "online" or "offline"'),
        ("[[adopt]]\nuser = 'bob'\nclass = 'batch'", "adopt[0].class", "one of 'online', 'offline', 'marker'"),
        ("[[adopt]]\nuser = 'bob'\nclass = 'offline'\nslo_p99 = '40ms'", "adopt[0].slo_p99", "online clients only"),
        ("[[adopt]]\nuser = 'bob'\nclass = 'online'\nslo_p99 = '0s'", "adopt[0].slo_p99", "out of range"),
        ("[[adopt]]\nuser = 'bob'\nclass = 'online'\nsm_pct = 0", "adopt[0].sm_pct", "out of range"),
        ("[[adopt]]\nuser = 'bob'\nclass = 'online'\nmem = '512K'", "adopt[0].mem", "out of range"),
        ("[[adopt]]\ncgroup = 'system.slice/*'\nclass = 'online'", "adopt[0].cgroup", "cgroup v2 path from the hierarchy's root"),
        ("[[adopt]]\nunit = 'my unit'\nclass = 'online'", "adopt[0].unit", "not a unit name or glob"),
        ("[[adopt]]\nuser = 'Bob Smith'\nclass = 'online'", "adopt[0].user", "not a user name or uid"),
        ("[[adopt]]\nenv = { 'A-B' = 'x' }\nclass = 'online'", "adopt[0].env.A-B", "not an environment variable name"),
        ("[[adopt]]\nenv = { A = 1 }\nclass = 'online'", "adopt[0].env.A", "expected a string"),
        ("[[adopt]]\nenv = 'A=1'\nclass = 'online'", "adopt[0].env", "expected a table such as"),
        ("[[adopt]]\nuser = 'bob'\nclass = 'online'\nbogus = 1", "adopt[0].bogus", "unknown key"),
        ("adopt = 3", "adopt", "expected [[adopt]] tables"),
        ("[[adopt]]\nname = 'a'\nuser = 'x'\nclass = 'online'\n[[adopt]]\nname = 'a'\nuser = 'y'\nclass = 'online'",
         "adopt[1].name", "'a' names an earlier rule too"),
    ],
)  # fmt: skip
def test_bad_adopt_tables_name_file_key_and_fix(text, key, hint):
    with pytest.raises(ConfigError) as info:
        config.loads(text, ROOT_CFG)
    assert info.value.key == key
    assert hint in info.value.reason
