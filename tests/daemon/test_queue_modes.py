"""Shallow offline queues: submit --queue / --inflight-from arguments, how auto decides, the launch
environment, and the registry columns an older database gains."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.support.trusted import SKIP_REASON, make_trusted_dir, trusted_base
from gpushare import config as config_mod
from gpushare import native
from gpushare.cli.app import app
from gpushare.config import ConfigError, GateConfig
from gpushare.daemon.core import Daemon
from gpushare.daemon.launcher import SHALLOW_MARKERS, choose_queue, queue_env, shallow_how
from gpushare.daemon.registry import Registry
from gpushare.daemon.registry import store as registry_store
from gpushare.model import ClientClass, ClientState
from gpushare.mpsenv import workload_env
from gpushare.node.signal_pauser import SignalPauser
from tests.fakes.fake_gpu import FakeGpuBackend
from tests.fakes.fake_mps import FakeMpsNode

runner = CliRunner()


def test_choose_queue() -> None:
    assert choose_queue("shallow", gating_on=False)[0] == "shallow"
    assert choose_queue("deep", gating_on=True)[0] == "deep"
    assert choose_queue(None, gating_on=True) == ("deep", "default queue (deep)")
    mode, why = choose_queue("auto", gating_on=True)
    assert mode == "shallow"
    assert "gating is on" in why
    mode, why = choose_queue("auto", gating_on=False)
    assert mode == "deep"
    assert "gating is off" in why


def test_queue_env_bounds_in_flight_kernels_or_blocks_and_says_which() -> None:
    bounded = GateConfig(shallow_queue="bounded", inflight_kernels=3)
    env, how = queue_env("shallow", bounded, "/opt/gs/libgpushare_inflight.so")
    assert env == {"LD_PRELOAD": "/opt/gs/libgpushare_inflight.so", "GPUSHARE_MAX_INFLIGHT": "3"}
    assert "at most 3 kernels in flight" in how
    # Not built: still shallow (a freeze bites within a kernel), by the documented variable, and
    # the reason names the fix.
    env, how = queue_env("shallow", bounded, None)
    assert env == {"CUDA_LAUNCH_BLOCKING": "1"}
    # ... one a wheel user can run (issue 28.6): no make target, which only a clone has.
    assert "make native" not in how
    assert "sudo gpushare install" in how
    blocking = GateConfig(shallow_queue="blocking")
    assert queue_env("shallow", blocking, "/opt/gs/lib.so")[0] == {"CUDA_LAUNCH_BLOCKING": "1"}
    assert queue_env("deep", bounded, "/opt/gs/lib.so") == ({}, "deep")


def test_a_readopted_client_is_shallow_by_either_variable() -> None:
    assert shallow_how({"CUDA_LAUNCH_BLOCKING": "1"}) == "blocking"
    assert shallow_how({"GPUSHARE_MAX_INFLIGHT": "2", "LD_PRELOAD": "/x.so"}) == "2 in flight"
    assert shallow_how({"CUDA_LAUNCH_BLOCKING": "0"}) is None
    assert shallow_how({}) is None
    # The control file too: a re-adopted live auto client follows its GPU's file (issue 32).
    assert set(SHALLOW_MARKERS) == {
        "CUDA_LAUNCH_BLOCKING",
        "GPUSHARE_MAX_INFLIGHT",
        "GPUSHARE_INFLIGHT_CONTROL",
    }


def test_the_preload_goes_in_front_of_the_workloads_own() -> None:
    ours = {"LD_PRELOAD": "/gs/lib.so", "GPUSHARE_MAX_INFLIGHT": "2"}
    assert workload_env({"LD_PRELOAD": " /x/a.so "}, ours)["LD_PRELOAD"] == "/gs/lib.so:/x/a.so"
    assert workload_env({}, ours)["LD_PRELOAD"] == "/gs/lib.so"
    # A deep client gets no preload of ours and keeps the caller's as it was.
    assert workload_env({"LD_PRELOAD": "/x/a.so"}, {})["LD_PRELOAD"] == "/x/a.so"


def test_the_shallow_queue_keys_are_validated() -> None:
    for text, key in (
        ('[gate]\nshallow_queue = "fast"\n', "gate.shallow_queue"),
        ("[gate]\ninflight_kernels = 0\n", "gate.inflight_kernels"),
        ('[gate]\ninflight_kernels = "2"\n', "gate.inflight_kernels"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            config_mod.loads(text)


def test_submit_refuses_bad_queue_and_gauge_arguments_before_calling_the_daemon(
    tmp_path: Path,
) -> None:
    sock = str(tmp_path / "absent.sock")  # never reached: every case fails before connecting
    cases = {
        ("--offline", "--queue", "medium"): "--queue must be one of shallow, deep, auto",
        ("--online", "--queue", "shallow"): "--queue applies to --offline jobs",
        (
            "--offline",
            "--inflight-from",
            "prometheus:http://127.0.0.1:1/m#g",
        ): "--inflight-from applies to --online clients",
        # Issue 32: a declared restart cost.
        ("--online", "--restart-cost", "90s"): "--restart-cost applies to --offline jobs",
        (
            "--offline",
            "--restart-cost",
            "200h",
        ): "--restart-cost must be a duration from 0s to 168h",
        ("--offline", "--restart-cost", "soon"): "soon",
    }
    for args, message in cases.items():
        result = runner.invoke(app, ["submit", "--socket", sock, *args, "--", "true"])
        assert result.exit_code == 2, result.output
        assert message in result.output


def test_an_older_database_gains_the_new_columns(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    conn = sqlite3.connect(db)
    old_schema = registry_store.SCHEMA.replace("    inflight_from TEXT,\n    queue TEXT,\n", "")
    assert old_schema != registry_store.SCHEMA
    conn.executescript(old_schema)
    conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '1')")
    conn.commit()
    conn.close()
    reg = Registry.open(db)
    try:
        rec = reg.add_client(
            cls=ClientClass.OFFLINE,
            argv=["train"],
            uid=0,
            gid=0,
            user="root",
            state=ClientState.QUEUED,
            priority=1,
        )
        assert rec.queue is None
        assert reg.update(rec.id, queue="auto", inflight_from=None).queue == "auto"
        # Issue 32: a job's declared restart cost (a REAL column an older database gains).
        assert rec.restart_cost_s is None
        assert reg.update(rec.id, restart_cost_s=90.0).restart_cost_s == 90.0
    finally:
        reg.close()
    cols = {r[1] for r in sqlite3.connect(db).execute("PRAGMA table_info(clients)")}
    assert {"queue", "inflight_from", "restart_cost_s"} <= cols


@pytest.mark.parametrize("reason", [None, "/x/lib.so is not readable by other users (chmod o+r)"])
def test_a_daemon_whose_clients_cannot_preload_the_bound_says_shallow_queues_will_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reason: str | None
) -> None:
    monkeypatch.setattr(native, "unusable_reason", lambda lib=None: reason)
    cfg = config_mod.loads(f"""version = 1
[paths]
runtime_dir = "{tmp_path}/run"
state_dir = "{tmp_path}/state"
[probe]
enabled = false
[metrics]
enabled = false
[gate]
shallow_queue = "bounded"
""")
    d = Daemon(
        cfg, registry=Registry.open(cfg.paths.resolved("database")), gpu=FakeGpuBackend(),
        mps=FakeMpsNode(pipe_root=tmp_path / "mps"), pauser=SignalPauser(), notify=lambda *f: True,
    )  # fmt: skip
    d.start()
    try:
        warned = [e for e in d.registry.events(0, 100) if e.kind == "shallow_queue_blocking"]
        if reason is None:
            assert warned == []
            assert d.state.shallow_library == str(native.library_path())
        else:
            assert len(warned) == 1
            assert warned[0].severity == "warning"
            assert warned[0].message == (
                f'{reason}: [gate] shallow_queue = "bounded" falls back to CUDA_LAUNCH_BLOCKING=1'
            )
            assert d.state.shallow_library is None
    finally:
        d.shutdown()
        d.registry.close()


def test_the_bound_is_usable_only_where_every_user_can_load_it() -> None:
    # Root's and searchable by all (gpushare.trust refuses /tmp), not pytest's private tmp_path.
    if trusted_base() is None:
        pytest.skip(SKIP_REASON)
    base = make_trusted_dir("gs-native-")
    try:
        lib = base / "pkg" / native.LIBRARY_NAME
        assert "is not built" in (native.unusable_reason(lib) or "")
        lib.parent.mkdir(mode=0o755)
        lib.write_bytes(b"\x7fELF")
        lib.chmod(0o644)
        assert native.unusable_reason(lib) is None
        lib.chmod(0o600)
        assert "not readable by other users" in (native.unusable_reason(lib) or "")
        lib.chmod(0o644)
        lib.parent.chmod(0o700)  # a clone under a private home directory
        why = native.unusable_reason(lib) or ""
        assert f"{lib.parent} is not searchable by other users" in why
        assert f"chmod o+x {lib.parent}" in why
    finally:
        shutil.rmtree(base)
