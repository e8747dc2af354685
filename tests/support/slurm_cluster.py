"""A real single-node Slurm (munged, slurmctld, slurmd from the distribution) under a temp directory.

Started once per test module; it needs root (Slurm's daemons switch to the job's user) and the
binaries that ``scripts/get-slurm.sh`` installs. Everything runs in the foreground as this
process's children, with its own munge socket, ports, state and spool directories, so it neither
needs nor touches a system Slurm. :meth:`SlurmCluster.stop` ends every process that carries this
cluster's ``SLURM_CONF`` (daemons, job step daemons, tasks) and removes the directory. Job ids
start at a random number, so that a daemon adopting by ``SLURM_JOB_ID`` in one test never takes
the job of another test cluster running beside it.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpushare.node.procs.facts import all_pids, read_environ

NODE = "gstest"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")


def skip_reason() -> str | None:
    """Why this machine cannot run the cluster, or ``None``."""
    if os.geteuid() != 0:
        return "Slurm's daemons must run as root to start jobs (run the suite as root)"
    missing = [
        b
        for b in BINARIES
        if shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin") is None
    ]
    if missing:
        return f"{', '.join(missing)} not installed: scripts/get-slurm.sh installs them (root, apt-get)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SlurmCluster:
    """A running cluster and the commands that talk to it."""

    base: Path
    conf: Path
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(
        self, *argv: str, user: str | None = None, timeout_s: float = 60, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm command, as ``user`` when given, with ``env`` added to its environment."""
        cmd = ["runuser", "-u", user, "--", *argv] if user else list(argv)
        return subprocess.run(cmd, env={**self.env, **env}, capture_output=True, text=True,
                              timeout=timeout_s, check=False, cwd="/tmp")  # fmt: skip

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(w.split("=", 1) for w in out.split() if "=" in w)

    def wait_job(
        self, job_id: str, states: tuple[str, ...], timeout_s: float = 60
    ) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            assert time.monotonic() < deadline, f"job {job_id} never reached {states}: {info}"
            time.sleep(0.1)

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-n", NODE, "-o", "%T").stdout.strip()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "--quiet", "-w", NODE, timeout_s=20)
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.daemons:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # slurmstepd and the tasks are no children of ours; they carry this cluster's SLURM_CONF.
        for pid in all_pids():
            with contextlib.suppress(PermissionError):
                if (read_environ(pid, ["SLURM_CONF"]) or {}).get("SLURM_CONF") == str(self.conf):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        _remove_empty_cgroups()
        shutil.rmtree(self.base, ignore_errors=True)


def start(
    *,
    prolog: Path,
    task_prolog: Path,
    epilog: Path,
    cpus: int = 8,
    gres: str | None = None,
    cgroups: str | None = None,
    before_slurmctld: Callable[[SlurmCluster], None] | None = None,
) -> SlurmCluster:
    """Start munged, slurmctld and slurmd; return once the node is idle.

    Args:
        gres: the node's generic resources (``gpu:1,mps:100``), with :func:`fake_gpu_gres` lines
            in ``<base>/gres.conf`` for a GPU that is a device file only.
        cgroups: ``cgroup/v1`` or ``cgroup/v2``: track each step in a cgroup of its own
            (``proctrack/cgroup``, :func:`cgroup_conf`), each step's usage gathered for
            ``sstat``; ``None``: by its process tree (``proctrack/linuxproc``).
        before_slurmctld: called once munged runs, before slurmctld starts (e.g. to start a
            slurmdbd that authenticates through this cluster's munge, and add to slurm.conf).

    Raises:
        AssertionError: a daemon exited or the node did not come up; the logs are in the message.
    """
    base = _make_base()
    sock = base / "sock" / "munge"
    conf = base / "slurm.conf"
    if gres is not None:
        (base / "gres.conf").write_text(fake_gpu_gres(base))
    conf.write_text(_slurm_conf(base, sock, prolog, task_prolog, epilog, cpus, gres))
    if cgroups is not None:
        _use_cgroups(conf, cgroups)
    cluster = SlurmCluster(base, conf)
    _start_daemons(cluster, sock, before_slurmctld)
    return cluster


def _make_base() -> Path:
    """The cluster's directory: its munge key, socket, state, spool and log subdirectories."""
    base = Path(tempfile.mkdtemp(prefix="gsl-", dir="/tmp"))  # short: Unix socket path limit
    base.chmod(0o755)
    for sub in ("munge", "sock", "state", "spool", "log"):
        (base / sub).mkdir()
    (base / "munge").chmod(0o700)
    (base / "sock").chmod(0o755)
    key = base / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    return base


def _slurm_conf(
    base: Path,
    sock: Path,
    prolog: Path,
    task_prolog: Path,
    epilog: Path,
    cpus: int,
    gres: str | None,
) -> str:
    """slurm.conf of a one-node cluster under ``base`` running the given scripts (:func:`start`)."""
    return f"""ClusterName=gpushare-test
FirstJobId={random.randrange(10_000, 60_000_000)}
SlurmctldHost=localhost
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=2
Prolog={prolog}
TaskProlog={task_prolog}
Epilog={epilog}
{f"GresTypes=gpu,mps{chr(10)}" if gres is not None else ""}\
NodeName={NODE} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN\
{f" Gres={gres}" if gres is not None else ""}
PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


def _start_daemons(
    cluster: SlurmCluster,
    sock: Path,
    before_slurmctld: Callable[[SlurmCluster], None] | None,
) -> None:
    """Start munged, slurmctld and slurmd in turn; return once the node is idle, else stop all.

    ``before_slurmctld`` runs once munged's socket is up (:func:`start`).
    """
    base = cluster.base
    key = base / "munge" / "munge.key"
    env = cluster.env
    logs = [base / "log" / n for n in ("munged.log", "slurmctld.log", "slurmd.log")]
    argvs = [
        ["munged", "-F", f"--socket={sock}", f"--key-file={key}", f"--pid-file={base}/munge/pid",
         f"--log-file={logs[0]}", f"--seed-file={base}/munge/seed"],
        ["slurmctld", "-D", "-i"],
        ["slurmd", "-D", "-N", NODE],
    ]  # fmt: skip
    try:
        for argv in argvs:
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                    stderr=(base / "log" / f"{argv[0]}.stderr").open("wb"))  # fmt: skip
            cluster.daemons.append(proc)
            if argv[0] == "munged":
                _wait(lambda: sock.exists(), cluster, logs, "munged's socket")
                if before_slurmctld is not None:
                    before_slurmctld(cluster)
        _wait(lambda: cluster.node_state() == "idle", cluster, logs, "the node to be idle")
    except BaseException:
        cluster.stop()
        raise


def fake_gpu_gres(base: Path) -> str:
    """gres.conf for one GPU whose device file is a character device with nothing behind it.

    Slurm only names the file (and reads its device number for cgroup constraints); no driver is
    opened. The node ``<base>/dev/nvidia0`` (NVIDIA's major 195) stays inside the cluster's own
    directory, so the host's /dev is not touched.
    """
    dev = base / "dev"
    dev.mkdir(exist_ok=True)
    node = dev / "nvidia0"
    if not node.exists():
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(195, 0))
    return f"Name=gpu File={node}\nName=mps Count=100 File={node}\n"


def _wait(
    ready: object, cluster: SlurmCluster, logs: list[Path], what: str, timeout_s: float = 30
) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():  # type: ignore[operator]
        dead = [p.args[0] for p in cluster.daemons if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = {
                p.name: p.read_text()[-1500:]
                for p in [*logs, *cluster.base.joinpath("log").glob("*.stderr")]
                if p.exists()
            }
            raise AssertionError(f"waiting for {what}: exited {dead}; logs {tails}")
        time.sleep(0.1)


# ------------------------------------------------------------------------- cgroup tracking


def cgroup_conf(plugin: str, mount: Path) -> str:
    """The ``cgroup.conf`` of a cluster whose steps live in cgroups (``plugin`` under ``mount``).

    Slurm 22.05's ``cgroup/v2`` asks systemd (over D-Bus) for a scope for its step daemons; there
    is no systemd here, so ``IgnoreSystemd`` has it make that cgroup itself. No resource is
    constrained: the cgroups are for tracking (``proctrack/cgroup``), and on a hybrid host the
    unified hierarchy may have no controller to constrain with.
    """
    return (
        f"CgroupPlugin={plugin}\nCgroupMountpoint={mount}\n"
        + ("IgnoreSystemd=yes\n" if plugin == "cgroup/v2" else "")
        + "ConstrainCores=no\nConstrainRAMSpace=no\nConstrainSwapSpace=no\nConstrainDevices=no\n"
    )


def _use_cgroups(conf: Path, plugin: str) -> None:
    # Kept apart from the template above so that other changes of slurm.conf merge cleanly.
    from gpushare.node.cgroups.discovery import cgroup2_mount

    # cgroup/v1 finds each controller's hierarchy under the mount point; v2 needs the unified one.
    mount = cgroup2_mount() if plugin == "cgroup/v2" else Path("/sys/fs/cgroup")
    if mount is None:
        raise AssertionError("no cgroup v2 mount: see cgroup_skip_reason()")
    text = conf.read_text()
    text = text.replace("ProctrackType=proctrack/linuxproc", "ProctrackType=proctrack/cgroup")
    text = text.replace("TaskPlugin=task/none", "TaskPlugin=task/cgroup")
    # Accounting of each step's processes (sstat), which proctrack/cgroup lists.
    text = text.replace(
        "JobAcctGatherType=jobacct_gather/none",
        "JobAcctGatherType=jobacct_gather/linux\nJobAcctGatherFrequency=1",
    )
    conf.write_text(text)
    (conf.parent / "cgroup.conf").write_text(cgroup_conf(plugin, mount))


def _remove_empty_cgroups() -> None:
    # cgroup/v1 leaves its per-node directory (and, when a step daemon is killed, the step's) in
    # each hierarchy; rmdir removes only empty ones, so another cluster's running jobs stay.
    for top in Path("/sys/fs/cgroup").glob(f"*/slurm_{NODE}"):
        for sub in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if sub.is_dir():
                with contextlib.suppress(OSError):
                    sub.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()
