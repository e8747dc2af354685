"""Slurm's own MPS sharing: ``--gres=mps:N`` jobs become gpushare clients with that SM share.

On the real single-node Slurm of tests/cluster/conftest.py, started here with ``gpu:1,mps:100``
GRES whose GPU is a fake device file (tests/support/slurm_cluster.py ``fake_gpu_gres``: a
character device with no driver behind it; Slurm only names it). What slurmd gives the Prolog
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, ``SLURM_JOB_PARTITION``) is Slurm's own.
"""

from __future__ import annotations

import pwd
import re

import pytest

from bench.support.daemon_helpers import wait_for
from gpushare import slurm
from gpushare.model import ClientClass
from tests.support.slurm_harness import GPU, _env_of, _job_clients

SLURM_GRES = "gpu:1,mps:100"

ONLINE_TEST = slurm.OnlineRule(partitions=frozenset({"serve"}), qos=frozenset({"interactive"}))


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, None),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}, slurm.JobClass(ClientClass.OFFLINE, sm_pct=30.0)),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "SLURM_JOB_PARTITION": "serve"},
         slurm.JobClass(ClientClass.ONLINE)),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "SLURM_JOB_QOS": "interactive"},
         slurm.JobClass(ClientClass.ONLINE)),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "SLURM_JOB_PARTITION": "batch",
          "SLURM_JOB_QOS": "normal"}, slurm.JobClass(ClientClass.OFFLINE, sm_pct=30.0)),
        # The comment wins: its class, and its sm= over the gres share.
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "SLURM_JOB_COMMENT": "gpushare=offline,sm=20"},
         slurm.JobClass(ClientClass.OFFLINE, sm_pct=20.0)),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "SLURM_JOB_COMMENT": "gpushare=offline"},
         slurm.JobClass(ClientClass.OFFLINE, sm_pct=30.0)),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "SLURM_JOB_PARTITION": "serve",
          "SLURM_JOB_COMMENT": "gpushare=offline"}, slurm.JobClass(ClientClass.OFFLINE, sm_pct=30.0)),
        ({"SLURM_JOB_COMMENT": "gpushare=online", "SLURM_JOB_PARTITION": "batch"},
         slurm.JobClass(ClientClass.ONLINE)),
    ],
)  # fmt: skip
def test_the_class_and_share_of_a_job(env, want):
    assert slurm.job_class(env, ONLINE_TEST) == want


def test_without_online_partitions_every_gres_job_is_offline():
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "SLURM_JOB_PARTITION": "serve"}
    assert slurm.job_class(env) == slurm.JobClass(ClientClass.OFFLINE, sm_pct=50.0)


@pytest.mark.parametrize(
    ("share", "message"),
    [("0.5", "at least 1"), ("lots", "no percentage"), ("150", "(0, 100]")],
)
def test_a_share_gpushare_cannot_give_is_refused_with_the_fix(share, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        slurm.job_class({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": share})


# ------------------------------------------------------------------------------ a real Slurm


def test_a_gres_mps_job_gets_its_share_as_an_offline_client(recorded):
    h = recorded
    job = h.sbatch("--gres=mps:30", wrap="env")
    h.cluster.wait_job(job, ("COMPLETED",))
    env = _env_of(h.output(job))
    assert env["GPUSHARE_CLASS"] == "offline"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == f"{h.base}/run/mps/{GPU}"
    assert env["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    # Slurm's gres/mps set it for the task; the TaskProlog unsets it (the MPS server maps the GPU
    # to device 0).
    assert "CUDA_VISIBLE_DEVICES" not in env
    params, peer_uid = h.use_recorder().wait("adopt", job)
    assert peer_uid == 0
    assert (params["cls"], params["sm_pct"]) == ("offline", 30.0)
    assert params["match_env"] == {"SLURM_JOB_ID": job, "GPUSHARE_CLASS": "offline"}
    h.use_recorder().wait("release", job)


def test_a_gres_mps_job_becomes_a_client_of_a_real_daemon_with_that_share(with_daemon):
    h = with_daemon
    job = h.sbatch("--gres=mps:40", wrap="sleep 300")
    try:
        client = wait_for(lambda: _job_clients(h, job).get(job), 30, "the gres/mps job adopted")
        assert client["class"] == "offline"
        assert client["sm_pct"] == 40.0
        uid = pwd.getpwnam(h.user).pw_uid if h.user else 0
        assert client["uid"] == uid
    finally:
        h.cluster.run("scancel", job)
    h.cluster.wait_job(job, ("CANCELLED",))
    wait_for(lambda: not _job_clients(h, job), 30, "the client to end")
