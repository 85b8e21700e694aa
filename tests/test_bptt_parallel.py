"""BPTT state carrying under tensor, pipeline and data parallelism (docs/bptt.md): real torchrun jobs over
gloo train the same tiny hybrid (Mamba-2 + sliding-window attention, whose KV cache is carried) as one
process, step for step; their checkpoints hold the canonical carried states, so a run resumes in another
layout. (CP with BPTT: tests/test_parallel_cp.py.)"""
import os
from functools import partial

import pytest
import torch

from megassm.config import ConfigError, load_config

from multiproc import train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = [
    "data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=32", "model.mamba.d_state=8",
    "model.mamba.headdim=8", "model.mamba.chunk_size=8", "model.attn.n_heads=2", "model.attn.sliding_window=12",
    "model.mlp.ffn_hidden=64", "train.seq_len=32", "train.micro_batch=2", "train.global_batch=4",
    "train.bptt=true", "train.log_interval=1", "train.eval_interval=0", "optim.warmup_steps=2", "optim.lr=3e-3",
    "run.progress=false", "run.tensorboard=false", "train.steps=4", "train.device=cpu", "run.save_interval=2",
]


_run = partial(train_losses, base=TINY)


def _close(a, b, rel=2e-5):
    return set(a) == set(b) and all(abs(a[s] - b[s]) <= rel * abs(b[s]) for s in b)


def _ckpt(run_dir, step=2):
    return run_dir / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("bptt-par") / "single"
    return d, _run(d)


LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "dp2": (2, []),
    "pp2": (2, ["parallel.pp=2"]),
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "pp2-dp2": (4, ["parallel.pp=2"]),
}


# on CPU, TP and PP alone are covered inside the 4-rank combinations (the suite's 20-minute budget on 2 cores)
@pytest.mark.parametrize("layout", ["dp2", "tp2-pp2", "pp2-dp2"])
def test_parallel_bptt_matches_one_process_and_resumes_there(single, tmp_path, layout):
    """Every step's loss equals the one-process run's; the step-2 checkpoint (canonical carried states:
    all rows, all blocks, full heads) resumed by one process continues the one-process run exactly."""
    one_dir, one = single
    nproc, extra = LAYOUTS[layout]
    par = _run(tmp_path / "par", nproc=nproc, extra=extra)
    assert _close(par, one), (par, one)
    resumed = _run(tmp_path / "resumed", resume=_ckpt(tmp_path / "par"))
    assert _close(resumed, {s: one[s] for s in (3, 4)}), (resumed, one)


def test_one_process_checkpoint_resumes_under_tp_and_pp(single, tmp_path):
    """The other direction: one process's carried states are sliced into TP shards, PP stages and DP rows."""
    one_dir, one = single
    resumed = _run(tmp_path / "r", nproc=4, extra=["parallel.tp=2", "parallel.pp=2"], resume=_ckpt(one_dir))
    assert _close(resumed, {s: one[s] for s in (3, 4)}), (resumed, one)


def test_k2_window_backprop_under_tp_and_dp(tmp_path):
    """train.bptt_windows=2 (gradients through the carried state into the previous window) with TP2 x DP2
    (sequence parallel on) equals one process."""
    extra = ["train.bptt_windows=2", "train.steps=3", "run.save_interval=0"]
    one = _run(tmp_path / "one", extra=extra)
    par = _run(tmp_path / "par", nproc=4, extra=[*extra, "parallel.tp=2", "parallel.sp=true"])
    assert _close(par, one), (par, one)


def test_pp_refuses_k_window_backprop(monkeypatch):
    from megassm.training.trainer import check_supported

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(None, ["data.builtin=stdlib", "train.bptt=true", "train.bptt_windows=2", "parallel.pp=2",
                             "model.pattern=M-M-"])
    with pytest.raises(ConfigError, match="train.bptt_windows=2 with parallel.pp=2"):
        check_supported(cfg)
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_supported(load_config(None, ["data.builtin=stdlib", "train.bptt=true", "parallel.pp=2", "parallel.tp=2",
                                       "model.pattern=M-M-"]))  # truncated BPTT composes with PP x TP


# ----------------------------------------------------------------------------------------------------
# NCCL (`pytest -m gpu tests/test_bptt_parallel.py`, 4 GPUs: nvidia-h200-x4)
# ----------------------------------------------------------------------------------------------------
GPU = ["train.device=cuda", "train.precision=fp32"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,kernels,rel", [("tp2", "torch", 1e-4), ("pp2", "torch", 1e-4),
                                                ("tp2-pp2", "torch", 1e-4), ("pp2-dp2", "torch", 1e-4),
                                                ("tp2-pp2", "auto", 2e-3)])
def test_nccl_parallel_bptt_matches_one_gpu(tmp_path, layout, kernels, rel):
    """The same runs on GPUs over NCCL: reference kernels (TF32 off) to 1e-4, the Triton kernels to 2e-3."""
    nproc, extra = LAYOUTS[layout]
    if not torch.cuda.is_available() or torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs")
    one = _run(tmp_path / "one", extra=GPU, env={"MEGASSM_KERNELS": kernels})
    par = _run(tmp_path / "par", nproc=nproc, extra=[*GPU, *extra], env={"MEGASSM_KERNELS": kernels})
    assert _close(par, one, rel), (par, one)
