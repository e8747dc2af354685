"""The offline priority chosen per GPU, carried out by the daemon (``SetOfflinePriority``).

An in-process daemon with real child processes, registry and status; a scripted policy stands in
for the controller (the rule itself: tests/control/test_offline_priority.py). What a GPU's
controller chose reaches the environment of the offline clients launched there from then on, their
records, ``status`` and the event log; a gang gets the online clients' priority only where every
GPU it spans chose it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.support.daemon_helpers import wait_for
from gpushare.daemon.core import Daemon
from gpushare.model import SetOfflinePriority
from tests.daemon.test_gang_control import (
    G0,
    G1,
    G2,
    ROOT,
    PerGpuPolicy,
    _submit,
    env,  # noqa: F401 (the fixture)
)

DUMP = "import os, sys; open(sys.argv[1], 'w').write(os.environ['CUDA_MPS_CLIENT_PRIORITY'])"


def _launched_priority(d: Daemon, tmp: Path, name: str, **where: str) -> tuple[str, int]:
    """The priority an offline client launched now sees in its environment, and its record's."""
    out = tmp / name
    sub = _submit(d, [sys.executable, "-c", DUMP, str(out)], **where)
    wait_for(lambda: out.exists() and out.read_text() != "", what=f"{name} wrote its priority")
    return out.read_text(), d.registry.get(sub["client_id"]).priority


def test_a_gpus_chosen_priority_reaches_the_offline_clients_launched_there(
    env: tuple[Daemon, PerGpuPolicy],  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    d, policy = env
    policy.pending = {G1: [SetOfflinePriority(G1, 0, "online well under its SLOs")]}
    d.run(max_ticks=1)
    assert _launched_priority(d, tmp_path, "on1", gpu="1") == ("0", 0)
    # Another GPU keeps the policy's own (1, below online clients).
    assert _launched_priority(d, tmp_path, "on2", gpu="2") == ("1", 1)
    # A gang runs at 0 only where every GPU it spans chose it.
    assert _launched_priority(d, tmp_path, "gang12", gpus="1,2") == ("1", 1)
    policy.pending = {G2: [SetOfflinePriority(G2, 0, "room on 2 as well")]}
    d.run(max_ticks=1)
    assert _launched_priority(d, tmp_path, "gang12b", gpus="1,2") == ("0", 0)
    # What status shows, and what the event log and the GPU's last action say.
    gpus = {g["uuid"]: g for g in d.api.status(ROOT, {})["gpus"]}
    assert [gpus[u]["offline_mps_priority"] for u in (G0, G1, G2)] == [1, 0, 0]
    last = d.state.ops.last_action(G1)
    assert last is not None and last.kind == "set_offline_priority"
    events = [e for e in d.registry.events(limit=1000) if e.kind == "offline_priority_changed"]
    assert [(e.gpu_uuid, "priority 0" in e.message) for e in events] == [(G1, True), (G2, True)]
    # Back to 1 (a violation): launches from then on are below online clients again; the same
    # priority sent again changes nothing and logs nothing.
    policy.pending = {G1: [SetOfflinePriority(G1, 1, "online at 1.02x its SLO")]}
    d.run(max_ticks=1)
    policy.pending = {G1: [SetOfflinePriority(G1, 1, "again")]}
    d.run(max_ticks=1)
    assert _launched_priority(d, tmp_path, "on1b", gpu="1") == ("1", 1)
    kinds = [e.kind for e in d.registry.events(limit=1000) if e.gpu_uuid == G1]
    assert kinds.count("offline_priority_changed") == 2, kinds
    assert json.dumps(d.api.status(ROOT, {})["gpus"][1]["offline_mps_priority"]) == "1"
