"""The adoption scan reads clients' cgroups only when it has something to act on (issue 29 item 6).

Every scan used to list every client's cgroup (a third of an idle node's scan at 8 x 200); now the
list is read every 30 s, and again at once when a scan finds a process to adopt or refuse, so a
process that left a client's tree but not its cgroup (a daemonized child) is still never taken
for a new client. A real daemon (fake GPU and MPS, real cgroup v2), a rule that matches the
client's environment, and a client whose child leaves its tree.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason
from bench.support.daemon_helpers import DaemonProc, wait_for

TOKEN = uuid.uuid4().hex
RULE = f'[[adopt]]\nname = "svc"\nmarker = true\nenv = {{ GSTEST_SCAN = "{TOKEN}" }}\n'


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    if (reason := cgroup_skip_reason()) is not None:
        pytest.skip(reason)
    d = DaemonProc(RULE, gpus=1, daemon_toml='adopt_scan_period = "100ms"\nadopt_min_age = "200ms"')
    try:
        yield d.start()
    finally:
        d.cleanup()


def _orphan_of(out: Path) -> int | None:
    try:
        text = out.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def test_a_daemonized_child_of_a_client_is_not_adopted_as_a_client_of_its_own(
    daemon: DaemonProc, tmp_path: Path
):
    out = tmp_path / "orphan.pid"
    out.touch(mode=0o666)
    time.sleep(0.5)  # scans before the client: its cgroup is not in the list read at the first
    # The subshell starts a sleep in the background and exits: the sleep leaves the client's
    # process tree (re-parented) but stays in its cgroup, with the client's environment.
    script = f"(sleep 60 & echo $! > {out}); exec sleep 60"
    env = {"PATH": os.environ["PATH"], "GSTEST_SCAN": TOKEN}
    c = daemon.submit_detached(["sh", "-c", script], env=env)
    wait_for(lambda: _orphan_of(out) is not None, 15.0, "the child to leave the tree")
    orphan = _orphan_of(out)
    assert orphan is not None
    ppid = int(Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert ppid != c["pid"]  # out of the client's tree
    time.sleep(2.0)  # twenty scans, the orphan old enough to be decided in each
    clients = daemon.call("list", {"all": True})["clients"]
    assert [x["id"] for x in clients] == [c["client_id"]], clients
    events = daemon.call("events", {})["events"]
    assert not [e for e in events if e["kind"].startswith("adoption")], events
