"""Fixtures of the tests on a real single-node Slurm (tests/support/slurm_harness.py).

``slurm_harness`` starts one cluster per test module, running the scripts of deploy/slurm/ with
only the path of the gpushare command changed; a module tunes it with ``SLURM_QOS``,
``SLURM_GRES`` and ``SLURM_PROLOG_ARGS``. ``recorded`` puts the recorder on the daemon's socket,
``with_daemon`` a real simulated daemon.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator

import pytest

from bench.support.daemon_helpers import install_package_for_others, python_for_others
from bench.support.trusted import make_trusted_dir
from gpushare.paths import repo_root
from tests.cluster import slurm_accounting
from tests.support import slurm_cluster
from tests.support.slurm_harness import Harness, _accounting, _has_nobody, _serve


@pytest.fixture(scope="module")
def slurm_harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    if (reason := slurm_cluster.skip_reason()) is not None:
        pytest.skip(reason)
    # A module that sets SLURM_QOS gets accounting with those QOS, allowed to root and the user.
    qos = getattr(request.module, "SLURM_QOS", None)
    if qos is not None and (reason := slurm_accounting.skip_reason()) is not None:
        pytest.skip(reason)
    python = python_for_others()
    base = make_trusted_dir("gss-")  # the daemon refuses a config under /tmp
    (base / "out").mkdir(mode=0o777)
    (base / "out").chmod(0o1777)
    (base / "gpushare.toml").write_text(
        f'[paths]\nruntime_dir = "{base}/run"\nsocket = "{base}/api.sock"\n'
    )
    # The gpushare command the scripts run: the checkout's package, with the test's config. The
    # TaskProlog runs as the job's user, who may not enter the clone (a checkout under root's home
    # or a 0700 mktemp -d), so the package is installed as an admin would: copied under this
    # root-owned 0755 directory, not read from the clone.
    lib = install_package_for_others(base / "lib")
    launcher = base / "gpushare"
    # What the scripts print is in no log the test reads: keep it for its failure messages.
    scripts_log = base / "scripts.log"
    scripts_log.touch(mode=0o666)
    scripts_log.chmod(0o666)  # the TaskProlog runs as the job's user
    # Each run's start and exit status are logged too (a Prolog killed by a signal prints nothing).
    launcher.write_text(
        f"#!/bin/sh\nexport GPUSHARE_CONFIG={base}/gpushare.toml PYTHONPATH={lib}\n"
        f'echo "$(date +%T.%N) gpushare $* (job $SLURM_JOB_ID): start" >>{scripts_log}\n'
        f"{python or sys.executable} -c 'from gpushare.cli.fast import main; main()' \"$@\""
        f" 2>>{scripts_log}\nstatus=$?\n"
        f'echo "$(date +%T.%N) gpushare $* (job $SLURM_JOB_ID): exit $status" >>{scripts_log}\n'
        "exit $status\n"
    )
    launcher.chmod(0o755)
    scripts = {}
    # A module's SLURM_PROLOG_ARGS are added to the Prolog's command (tests/cluster/test_slurm_qos.py).
    prolog_args = getattr(request.module, "SLURM_PROLOG_ARGS", "")
    for name in ("prolog", "task-prolog", "epilog"):
        text = (repo_root() / "deploy" / "slurm" / name).read_text()
        assert "exec /usr/bin/gpushare slurm " in text
        text = text.replace("/usr/bin/gpushare", str(launcher))
        if name == "prolog" and prolog_args:
            text = text.replace(" slurm prolog", f" slurm prolog {prolog_args}")
        scripts[name] = base / name
        scripts[name].write_text(text)
        scripts[name].chmod(0o755)
    # Jobs run as nobody where nobody can run a Python with gpushare; else as root.
    user = "nobody" if python is not None and _has_nobody() else None
    acct = None
    recorder = _serve(base / "api.sock")
    try:
        acct = _accounting(qos, user)
        cluster = slurm_cluster.start(
            prolog=scripts["prolog"],
            task_prolog=scripts["task-prolog"],
            epilog=scripts["epilog"],
            # A module that sets SLURM_GRES gets a node with those GRES (test_slurm_gres.py).
            gres=getattr(request.module, "SLURM_GRES", None),
            before_slurmctld=acct[1] if acct is not None else None,
        )
    except BaseException:
        recorder.shutdown()
        recorder.server_close()
        if acct is not None:
            acct[0].stop()
        shutil.rmtree(base, ignore_errors=True)
        raise
    h = Harness(cluster, recorder, base, user)
    try:
        yield h
    finally:
        cluster.stop()
        if acct is not None:
            acct[0].stop()
        h.stop_recorder()
        h.stop_daemon()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def recorded(slurm_harness: Harness) -> Harness:
    """The cluster with the recorder on the daemon's socket."""
    slurm_harness.use_recorder()
    return slurm_harness


@pytest.fixture
def with_daemon(slurm_harness: Harness) -> Harness:
    """The cluster with a real ``gpushare daemon --simulate 1`` on the socket."""
    slurm_harness.use_daemon()
    return slurm_harness
