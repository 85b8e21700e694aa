"""Faults under NCCL on 4 GPUs (`pytest -m gpu`; device kind nvidia-h100-x4), the GPU side of tests/test_faults.py:
a rank SIGKILLed between steps ends every rank within parallel.timeout_s plus torchrun's grace period, with no
checkpoint newer than the last complete one, and `--resume auto` continues with the losses of an uninterrupted
run; a rank that stalls for good trips NCCL's watchdog on the others after parallel.timeout_s and the job ends.
Skipped with fewer than 4 GPUs.

    source benchmarks/device_env.sh; pytest -m gpu tests/test_faults_gpu.py
"""
import os

import pytest
import torch

from test_faults import GRACE_S, _assert_no_rank_alive, _checkpoint_steps

from multiproc import launch, losses, run_train

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config", "configs/tiny.yaml", "train.steps=6", "train.log_interval=1", "train.eval_interval=0",
        "train.micro_batch=2", "train.global_batch=8", "train.device=cuda", "train.precision=fp32",
        "optim.warmup_steps=2", "run.progress=false", "run.tensorboard=false", "run.save_interval=2"]
ENV = {"MEGASSM_KERNELS": "torch"}  # fp32 reference kernels: the resume comparison is not blurred by bf16
START_S = 180  # start-up (CUDA context, NCCL communicators) and the first steps


@pytest.fixture(autouse=True)
def _four_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
        pytest.skip("needs 4 CUDA GPUs")


def test_nccl_killed_rank_ends_the_job_and_resume_auto_continues(tmp_path):
    run = tmp_path / "run"
    r = launch(ROOT, [*ARGS, f"run.dir={run}", "parallel.timeout_s=60"], nproc=4,
               env={**ENV, "MEGASSM_FAULT": "kill:3:4"}, timeout=900)
    assert r.returncode != 0, r.stderr[-3000:]
    assert "[rank 3] megassm: MEGASSM_FAULT=kill:3:4: killed before step 4" in r.stderr
    assert r.seconds < 60 + GRACE_S + START_S, r.seconds
    _assert_no_rank_alive(run, 4)
    assert _checkpoint_steps(run) == [2]

    resumed = losses(run_train(ROOT, [*ARGS, f"run.dir={run}", "--resume", "auto"], nproc=4, env=ENV, timeout=900))
    straight = losses(run_train(ROOT, [*ARGS, f"run.dir={tmp_path / 'straight'}"], nproc=4, env=ENV, timeout=900))
    assert sorted(resumed) == sorted(straight) == [1, 2, 3, 4, 5, 6]
    assert all(abs(resumed[s] - straight[s]) <= 1e-4 * abs(straight[s]) for s in straight), (resumed, straight)


def test_nccl_stalled_rank_trips_the_watchdog_and_the_job_ends(tmp_path):
    run = tmp_path / "run"
    r = launch(ROOT, [*ARGS, f"run.dir={run}", "parallel.timeout_s=30"], nproc=4,
               env={**ENV, "MEGASSM_FAULT": "hang:3:4"}, timeout=900)
    assert r.returncode != 0, r.stderr[-3000:]
    assert "[rank 3] megassm: MEGASSM_FAULT=hang:3:4: stalls before step 4" in r.stderr
    assert "Timeout(ms)=30000" in r.stderr, r.stderr[-5000:]  # the watchdog names the group's timeout
    assert r.seconds < 30 + GRACE_S + START_S, r.seconds
    _assert_no_rank_alive(run, 4)
    assert _checkpoint_steps(run) == [2]
