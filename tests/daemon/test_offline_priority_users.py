"""One user's online service cannot choose the online priority for offline work beside another's.

docs/security.md 3.1, with real second and third accounts. Two users' clients share a GPU only
where MPS runs ``-multiuser-server`` (docs/design.md D11): the fake MPS node here says so for GPU 0
through the ``supervisors`` its Protocol declares. A and B each submit an online service with a
100 ms p99 SLO, as themselves, each with its own ``--latency-from`` endpoint: A's reports 1 ms, B's
99 ms (inside the SLO, no room). The daemon's controller must keep offline launches below online
clients (1); once B's service has room too, they get priority 0 (the rule works here at all).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.support.accounts import Account
from bench.support.daemon_helpers import wait_for
from gpushare import config
from gpushare.control.registry import make_policy
from gpushare.daemon.core import Daemon
from gpushare.daemon.registry import Registry
from gpushare.daemon.server import Caller
from gpushare.model import ClientClass
from gpushare.node.signal_pauser import SignalPauser
from tests.fakes.fake_gpu import FakeGpuBackend, fake_uuid
from tests.fakes.fake_mps import FakeMpsNode
from tests.support.actions_daemon import stop_daemon
from tests.support.exposition import ExpositionServer

G0 = fake_uuid(0)


@dataclass(frozen=True)
class _Multiuser:
    """A GPU whose MPS control daemon runs ``-multiuser-server`` (``MultiuserInfo``)."""

    multiuser: bool = True


class _Histogram:
    """A request-latency histogram that grows by 20 requests of ``seconds`` per scrape."""

    BOUNDS = (0.002, 0.05, 0.1, 0.2)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.counts = dict.fromkeys(self.BOUNDS, 0)

    def body(self) -> bytes:
        """The exposition text of the next scrape."""
        for bound in self.BOUNDS:
            self.counts[bound] += 20 if self.seconds <= bound else 0
        total = self.counts[self.BOUNDS[-1]]
        lines = ["# TYPE req_latency_seconds histogram"]
        lines += [f'req_latency_seconds_bucket{{le="{b}"}} {n}' for b, n in self.counts.items()]
        lines += [f'req_latency_seconds_bucket{{le="+Inf"}} {total}',
                  f"req_latency_seconds_sum {total * self.seconds}",
                  f"req_latency_seconds_count {total}"]  # fmt: skip
        return ("\n".join(lines) + "\n").encode()


@pytest.fixture
def endpoints() -> Iterator[Callable[[float], tuple[_Histogram, str]]]:
    """Starts a service's latency endpoint (its histogram and URL); all closed at the end."""
    servers: list[ExpositionServer] = []

    def start(seconds: float) -> tuple[_Histogram, str]:
        hist = _Histogram(seconds)
        servers.append(ExpositionServer(hist.body))
        return hist, servers[-1].url

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    base = Path(tempfile.mkdtemp(prefix="gsu-", dir="/tmp"))
    base.chmod(0o755)  # the accounts' clients run with cwd "/", their logs are the daemon's
    cfg = config.loads(f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
[daemon]
cancel_grace = "1s"
[control]
period = "100ms"
share_min_interval = "1s"
[latency]
scrape_period = "100ms"
min_samples = 5
[probe]
enabled = false
""")
    mps = FakeMpsNode(pipe_root=base / "mps")
    mps.supervisors = {G0: _Multiuser()}
    d = Daemon(
        cfg, registry=Registry.open(cfg.paths.resolved("database")), gpu=FakeGpuBackend(gpus=1),
        mps=mps, pauser=SignalPauser(), policy=make_policy("gpushare", cfg.control),
        notify=lambda *f: True,
    )  # fmt: skip
    d.start()
    try:
        yield d
    finally:
        stop_daemon(d)
        shutil.rmtree(base, ignore_errors=True)


def _online_as(d: Daemon, user: Account, url: str) -> str:
    caller = Caller(pid=os.getpid(), uid=user.uid, gid=user.gid)
    out = d.api.submit(caller, {
        "cls": "online", "argv": ["sleep", "60"], "detach": True, "cwd": "/", "gpu": "0",
        "env": {"PATH": os.environ["PATH"]}, "slo_p99_ms": 100.0,
        "latency_from": f"prometheus:{url}#req_latency_seconds",
    })  # fmt: skip
    client_id: str = out["client_id"]
    assert d.registry.get(client_id).uid == user.uid
    return client_id


def _offline_priority(d: Daemon) -> int:
    return d.state.priority(ClientClass.OFFLINE, (G0,))


def test_one_users_low_latency_reports_do_not_give_offline_work_priority_0_beside_anothers(
    accounts: tuple[Account, Account, Account],
    endpoints: Callable[[float], tuple[_Histogram, str]],
    daemon: Daemon,
) -> None:
    a, b, _ = accounts
    _, url_a = endpoints(0.001)
    b_latency, url_b = endpoints(0.099)
    _online_as(daemon, a, url_a)
    web = _online_as(daemon, b, url_b)
    # Both services' p99s known, then three times share_min_interval with A's at 0.02x its SLO
    # and B's at 0.995x.
    wait_for(lambda: daemon.run(max_ticks=1) == 0 and _p99_known(daemon, web), 15.0, "p99")
    until = time.monotonic() + 3 * daemon.config.control.share_min_interval_s
    while time.monotonic() < until:
        daemon.run(max_ticks=1)
        time.sleep(daemon.config.control.period_s)
    assert _p99_known(daemon, web) and _offline_priority(daemon) == 1
    assert not [
        e for e in daemon.registry.events(limit=1000) if e.kind == "offline_priority_changed"
    ]
    # B's service gets room too: now every online client of the GPU shows it.
    b_latency.seconds = 0.001
    wait_for(lambda: daemon.run(max_ticks=1) == 0 and _offline_priority(daemon) == 0,
             15.0, "priority 0 once both services have room")  # fmt: skip


def _p99_known(d: Daemon, client_id: str) -> bool:
    p99 = d.state.p99.get(client_id)
    return p99 is not None and p99.p99_ms is not None
