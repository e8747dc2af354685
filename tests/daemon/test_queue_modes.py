"""Shallow offline queues: submit --queue / --inflight-from arguments, how auto decides, the launch
environment, and the registry columns an older database gains."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from typer.testing import CliRunner

from gpushare.cli.app import app
from gpushare.daemon import registry as registry_mod
from gpushare.daemon.launcher import choose_queue, queue_env
from gpushare.daemon.registry import Registry
from gpushare.model import ClientClass, ClientState

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
    assert queue_env("shallow") == {"CUDA_LAUNCH_BLOCKING": "1"}
    assert queue_env("deep") == {}


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
    }
    for args, message in cases.items():
        result = runner.invoke(app, ["submit", "--socket", sock, *args, "--", "true"])
        assert result.exit_code == 2, result.output
        assert message in result.output


def test_an_older_database_gains_the_new_columns(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    conn = sqlite3.connect(db)
    old_schema = registry_mod._SCHEMA.replace("    inflight_from TEXT,\n    queue TEXT,\n", "")
    assert old_schema != registry_mod._SCHEMA
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
    finally:
        reg.close()
    cols = {r[1] for r in sqlite3.connect(db).execute("PRAGMA table_info(clients)")}
    assert {"queue", "inflight_from"} <= cols
