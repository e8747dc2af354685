"""Slurm without a cluster: the gpushare declaration in a job's comment, and the one GPU of a task."""

from __future__ import annotations

import re

import pytest

from gpushare import slurm
from gpushare.model import ClientClass
from tests.support.slurm_harness import GPU


@pytest.mark.parametrize(
    ("comment", "want"),
    [
        (None, None),
        ("nightly run for team a", None),
        ("gpushare=offline", slurm.JobClass(ClientClass.OFFLINE)),
        ("team-a gpushare=online,slo-p99=40ms,sm=60,mem=20G x", slurm.JobClass(ClientClass.ONLINE, 0.04, 60.0, 20 << 30)),
    ],
)  # fmt: skip
def test_the_declaration_in_a_job_comment(comment, want):
    assert slurm.parse_comment(comment) == want


@pytest.mark.parametrize(
    ("comment", "message"),
    [
        ("gpushare=batch", "'batch' is not a gpushare class: use --comment gpushare=offline"),
        ("gpushare=", "'' is not a gpushare class"),
        ("gpushare=offline,slo-p99=40ms", "--slo-p99 applies to --online workloads only"),
        ("gpushare=online,sm=150", "--sm must be a percentage in (0, 100], got 150"),
        ("gpushare=online,sm=lots", "could not convert string to float"),
        ("gpushare=offline,mem=8Q", "expected a size such as 512M"),
        ("gpushare=offline,gpu=1", "'gpu=1' in the comment is not one of slo-p99=, sm=, mem="),
        ("gpushare=offline gpushare=online", "declares gpushare twice"),
    ],
)
def test_a_bad_declaration_names_the_fix(comment, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        slurm.parse_comment(comment)


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, None),
        ({"SLURM_JOB_GPUS": "3"}, "3"),
        ({"SLURM_STEP_GPUS": "2", "SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0"}, "2"),
        ({"SLURM_STEP_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "3"}, "3"),
        ({"CUDA_VISIBLE_DEVICES": GPU}, GPU),
        ({"CUDA_VISIBLE_DEVICES": "1"}, "1"),
    ],
)
def test_the_gpu_of_a_task(env, want):
    assert slurm.task_gpu(env) == want


@pytest.mark.parametrize(
    "env",
    [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"SLURM_STEP_GPUS": "0,1"}, {"SLURM_STEP_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0"}],
)  # fmt: skip
def test_a_task_on_several_gpus_is_refused(env):
    with pytest.raises(ValueError, match="one GPU|not one of the step's GPUs"):
        slurm.task_gpu(env)
