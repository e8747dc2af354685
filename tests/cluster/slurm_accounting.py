"""Slurm accounting for a test cluster: a private MariaDB and a slurmdbd, so that jobs have a QOS.

Without accounting (``AccountingStorageType=accounting_storage/none``) Slurm 22.05 accepts
``--qos=`` and keeps no QOS: ``scontrol show job`` says ``QOS=(null)``. A QOS exists only in the
accounting database, so the QOS tests need MariaDB (``mariadbd``, ``mariadb-install-db``) and
``slurmdbd`` from the distribution (``apt-get install mariadb-server slurmdbd``). Everything runs
under one temporary directory, on ports of its own, as children of the test process; the
database listens on 127.0.0.1 only. :meth:`Accounting.stop` ends both and removes the directory.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import slurm_cluster

BINARIES = ("mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "sacctmgr")
CLUSTER = "gpushare-test"  # slurm_cluster's ClusterName
ACCOUNT = "gstest"


def skip_reason() -> str | None:
    """Why this machine cannot run accounting, or ``None``."""
    path = os.environ.get("PATH", "") + ":/usr/sbin"
    missing = [b for b in BINARIES if shutil.which(b, path=path) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed: a QOS needs Slurm accounting "
            "(apt-get install mariadb-server slurmdbd)"
        )
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Accounting:
    """A MariaDB and a slurmdbd for one test cluster; QOS and users are added with :meth:`sacctmgr`."""

    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gsdb-", dir="/tmp")))
    db_port: int = field(default_factory=_free_port)
    dbd_port: int = field(default_factory=_free_port)
    password: str = field(default_factory=lambda: secrets.token_hex(12))
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    cluster: slurm_cluster.SlurmCluster | None = None

    def slurm_conf(self, munge_socket: Path) -> str:
        """The slurm.conf lines: jobs are accounted, and run only with an association and a QOS
        their association allows (a user cannot pick a QOS the site did not give them).

        A key given again wins over the template's (``accounting_storage/none``). Commands reach
        slurmdbd with the munge socket named by ``AccountingStoragePass``, not ``AuthInfo``.
        """
        return (
            "AccountingStorageType=accounting_storage/slurmdbd\n"
            f"AccountingStorageHost=localhost\nAccountingStoragePort={self.dbd_port}\n"
            f"AccountingStoragePass=socket={munge_socket}\n"
            "AccountingStorageEnforce=associations,limits,qos\n"
        )

    def start_database(self) -> None:
        """Initialise and start MariaDB; make the ``slurm`` user slurmdbd logs in as."""
        data, sock = self.base / "db", self.base / "mysqld.sock"
        self._run(["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
                   "--auth-root-authentication-method=socket", "--skip-test-db"], 120)  # fmt: skip
        self._spawn(
            ["mariadbd", "--no-defaults", f"--datadir={data}", f"--socket={sock}",
             f"--port={self.db_port}", "--bind-address=127.0.0.1", "--user=root",
             f"--pid-file={self.base}/mysqld.pid", "--innodb-buffer-pool-size=16M",
             "--skip-log-bin", f"--log-error={self.base}/mysqld.err"],
            "mariadbd",
        )  # fmt: skip
        self._wait(sock.exists, "MariaDB's socket", self.base / "mysqld.err")
        self._run(
            ["mariadb", f"--socket={sock}", "-uroot", "-e",
             f"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{self.password}'; "
             "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"],
            30,
        )  # fmt: skip

    def start_dbd(self, cluster: slurm_cluster.SlurmCluster) -> None:
        """Start slurmdbd with the cluster's munge; register the cluster and the test account.

        slurmdbd reads ``slurmdbd.conf`` beside ``$SLURM_CONF``, root-owned and mode 0600.
        """
        self.cluster = cluster
        conf = cluster.conf.parent / "slurmdbd.conf"
        conf.write_text(
            f"AuthType=auth/munge\nAuthInfo=socket={cluster.base}/sock/munge\n"
            f"DbdHost=localhost\nDbdPort={self.dbd_port}\nSlurmUser=root\n"
            f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\n"
            f"StoragePort={self.db_port}\nStorageUser=slurm\nStoragePass={self.password}\n"
            f"StorageLoc=slurm_acct_db\nLogFile={self.base}/slurmdbd.log\n"
            f"PidFile={self.base}/slurmdbd.pid\n"
        )
        conf.chmod(0o600)
        with cluster.conf.open("a") as f:
            f.write(self.slurm_conf(cluster.base / "sock" / "munge"))
        self._spawn(["slurmdbd", "-D"], "slurmdbd", env=cluster.env)
        self._wait(lambda: self.sacctmgr("show", "cluster", check=False).returncode == 0,
                   "slurmdbd to answer", self.base / "slurmdbd.log", timeout_s=90)  # fmt: skip
        self.sacctmgr("add", "cluster", CLUSTER)
        self.sacctmgr("add", "account", ACCOUNT, f"cluster={CLUSTER}")

    def add_user(self, user: str, *qos: str) -> None:
        """Give ``user`` an association in the test account, allowed these QOS."""
        self.sacctmgr("add", "user", user, f"account={ACCOUNT}", f"cluster={CLUSTER}")
        if qos:
            self.sacctmgr("modify", "user", user, "set", f"qos={','.join(qos)}")

    def sacctmgr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``sacctmgr -i ARGS`` against this cluster's slurmdbd."""
        assert self.cluster is not None
        done = self.cluster.run("sacctmgr", "-i", *args, timeout_s=30)
        if check:
            assert done.returncode == 0, f"sacctmgr {' '.join(args)}: {done.stdout}{done.stderr}"
        return done

    def stop(self) -> None:
        """End slurmdbd and MariaDB (newest first) and remove the directory."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()
        shutil.rmtree(self.base, ignore_errors=True)

    def _spawn(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> None:
        err = (self.base / f"{name}.stderr").open("wb")
        self.procs.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=self.base)
        )
        err.close()

    def _run(self, argv: list[str], timeout_s: float) -> None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        assert done.returncode == 0, f"{argv[0]}: {done.stdout[-1500:]}{done.stderr[-1500:]}"

    def _wait(self, ready: object, what: str, log: Path, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():  # type: ignore[operator]
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tail = ""
                with contextlib.suppress(OSError):
                    tail = log.read_text()[-2000:]
                raise AssertionError(f"waiting for {what}: exited {dead}; {log.name}: {tail}")
            time.sleep(0.2)
