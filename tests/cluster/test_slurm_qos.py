"""The online rule by QOS: the Prolog learns a gres/mps job's QOS from squeue (Slurm 22.05 gives
the Prolog its partition, not its QOS).

The real cluster here is tests/cluster/conftest.py's with accounting (tests/cluster/slurm_accounting.py:
a private MariaDB and slurmdbd), since Slurm keeps no QOS without it, the QOS ``interactive``
allowed to the job's user, and the Prolog run with ``--online-qos interactive``. What slurmd gives
the Prolog and what squeue answers are Slurm's own; the GPU is a device file only.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gpushare import slurm
from gpushare.model import ClientClass
from tests.support.slurm_harness import GPU, _env_of

SLURM_GRES = "gpu:1,mps:100"
SLURM_QOS = ("interactive",)
SLURM_PROLOG_ARGS = "--online-qos interactive"

RULE = slurm.OnlineRule(partitions=frozenset({"serve"}), qos=frozenset({"interactive"}))
GRES = {
    "SLURM_JOB_ID": "7",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
    "SLURM_JOB_PARTITION": "batch",
}


class _Asked:
    """A QosOf that records the jobs it was asked about."""

    def __init__(self, answer: str | LookupError) -> None:
        self.answer = answer
        self.jobs: list[str] = []

    def __call__(self, job: str) -> str:
        self.jobs.append(job)
        if isinstance(self.answer, LookupError):
            raise self.answer
        return self.answer


@pytest.mark.parametrize(
    ("env", "rule", "asked"),
    [
        (GRES, RULE, True),
        ({**GRES, "SLURM_JOB_QOS": "normal"}, RULE, False),  # Slurm gave it
        ({**GRES, "SLURM_JOB_PARTITION": "serve"}, RULE, False),  # online by partition already
        ({**GRES, "SLURM_JOB_COMMENT": "gpushare=offline"}, RULE, False),  # the comment wins
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_PARTITION": "batch"}, RULE, False),  # no gres/mps share
        (GRES, slurm.OnlineRule(partitions=frozenset({"serve"})), False),  # no online QOS named
    ],
)  # fmt: skip
def test_the_qos_is_asked_only_when_the_class_depends_on_it(env, rule, asked) -> None:
    qos_of = _Asked("interactive")
    out = slurm.with_qos(env, rule, qos_of, io.StringIO())
    assert qos_of.jobs == (["7"] if asked else [])
    if asked:
        assert out["SLURM_JOB_QOS"] == "interactive"
        assert slurm.job_class(out, RULE) == slurm.JobClass(ClientClass.ONLINE)


def test_an_unknown_qos_is_said_in_one_line_and_the_partition_decides() -> None:
    log = io.StringIO()
    out = slurm.with_qos(GRES, RULE, _Asked(LookupError("squeue gave no QOS")), log)
    assert "SLURM_JOB_QOS" not in out
    assert log.getvalue() == (
        "gpushare prolog: job 7: its QOS is unknown (squeue gave no QOS); classed by its "
        "partition alone\n"
    )
    assert slurm.job_class(out, RULE) == slurm.JobClass(ClientClass.OFFLINE, sm_pct=30.0)


def _fake_squeue(tmp_path: Path, body: str) -> str:
    path = tmp_path / "squeue"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize(
    ("body", "want"),
    [
        ('[ "$3" = --format=%q ] && [ "$2" = --jobs=7 ] && echo interactive', "interactive"),
        ("echo '(null)'", "a QOS needs Slurm accounting"),
        ("echo", "gave no QOS"),
        ("echo 'a b'", "gave no QOS"),
        ("echo 'squeue: error: Invalid job id specified' >&2; exit 1", "Invalid job id specified"),
        ("sleep 5", "timed out"),
    ],
)
def test_squeue_is_asked_for_the_one_field(tmp_path: Path, body: str, want: str) -> None:
    qos_of = slurm.squeue_qos(_fake_squeue(tmp_path, body), timeout_s=1.0)
    if want == "interactive":
        assert qos_of("7") == want
        return
    with pytest.raises(LookupError, match=want):
        qos_of("7")


def test_a_missing_squeue_names_the_option(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LookupError, match="pass --squeue"):
        slurm.squeue_qos()("7")


# ------------------------------------------------------------------------------ a real Slurm


@pytest.mark.parametrize(
    ("args", "cls", "sm"),
    [
        (["--qos=interactive"], "online", "100"),
        ([], "offline", "30"),  # the user's default QOS, normal
        # A job name that reads like a QOS in `scontrol show job -o` changes nothing.
        (["--job-name", "x QOS=interactive"], "offline", "30"),
    ],
)
def test_a_gres_mps_jobs_class_follows_its_qos(recorded, args, cls, sm) -> None:
    h = recorded
    job = h.sbatch("--gres=mps:30", *args, wrap="env")
    info = h.cluster.wait_job(job, ("COMPLETED",))
    assert info["QOS"] == ("interactive" if "--qos=interactive" in args else "normal")
    env = _env_of(h.output(job))
    assert (env["GPUSHARE_CLASS"], env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) == (cls, sm)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == f"{h.base}/run/mps/{GPU}"
    params, peer_uid = h.use_recorder().wait("adopt", job)
    assert (params["cls"], peer_uid) == (cls, 0)
    assert params["sm_pct"] == (None if cls == "online" else 30.0)
    h.use_recorder().wait("release", job)


def test_slurm_gives_the_prolog_no_path_and_no_qos(slurm_harness) -> None:
    # Why the Prolog asks squeue, found in fixed directories: slurmd builds the Prolog's
    # environment with neither PATH nor SLURM_JOB_QOS (Slurm 22.05), even for a job with a QOS.
    h = slurm_harness
    script, spy = h.base / "prolog", h.base / "prolog-env"
    original = script.read_text()
    try:
        script.write_text(f"#!/bin/sh\n/usr/bin/env > {spy}\n" + original.split("\n", 1)[1])
        job = h.sbatch("--gres=mps:10", "--qos=interactive", wrap="true")
        h.cluster.wait_job(job, ("COMPLETED",))
        env = _env_of(spy.read_text())
    finally:
        script.write_text(original)
        script.chmod(0o755)
    assert env["SLURM_JOB_ID"] == job
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
    assert "PATH" not in env
    assert "SLURM_JOB_QOS" not in env
