"""The tensor/sequence-parallel checks over NCCL on 2 and 4 GPUs (`pytest -m gpu`; device kinds
nvidia-h200-x2 / nvidia-h200-x4). Skipped when fewer GPUs are visible.

    pytest -m gpu tests/test_parallel_gpu.py -k "tp2"        # 2 GPUs
    pytest -m gpu tests/test_parallel_gpu.py                 # 4 GPUs: everything
"""
import json
import os
from functools import partial

import pytest
import torch

from multiproc import spawn, train_losses
from parallel_cases import equivalence_worker, layer_collectives


pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = [
    dict(pattern="MM", ngroups=2),
    dict(pattern="MM", ngroups=1, norm_before_gate=True, proj_bias=True),
    dict(pattern="M*M-", tie=False),
]
BIG = [dict(pattern="M*M-", ngroups=1, n_kv_heads=4, big=True), dict(pattern="MM", ngroups=8, big=True)]


def _need(n):
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs")


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)], ids=["tp2", "tp2-sp", "tp4", "tp4-sp"])
def test_nccl_tp_exact_reference_kernels(tmp_path, monkeypatch, tp, sp):
    """TP logic over NCCL with the PyTorch reference kernels (fp32, TF32 off): 1e-5 like on gloo."""
    _need(tp)
    monkeypatch.setenv("MEGASSM_KERNELS", "torch")
    out = tmp_path / "r.json"
    spawn(equivalence_worker, tp, tp, sp, [dict(c) for c in CASES], str(out), 3, "cuda", backend="nccl")
    for rec in json.loads(out.read_text()):
        assert rec["per_layer_fwd"] == layer_collectives(rec["case"], rec["kinds"], tp, sp)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)], ids=["tp2", "tp2-sp", "tp4", "tp4-sp"])
def test_nccl_tp_triton_real_shapes(tmp_path, monkeypatch, tp, sp):
    """d_model 1024, 32k vocab, seq 256 with the Triton kernels (tl.dot may use TF32): 2e-3 relative."""
    _need(tp)
    monkeypatch.setenv("MEGASSM_KERNELS", "auto")
    out = tmp_path / "r.json"
    spawn(equivalence_worker, tp, tp, sp, [dict(c) for c in BIG], str(out), 2, "cuda", 2e-3, 256, 2,
          backend="nccl")


GPU_BASE = ["train.steps=4", "train.log_interval=1", "train.eval_interval=0",
            "train.precision=fp32", "train.device=cuda", "run.progress=false", "run.tensorboard=false"]
_train = partial(train_losses, base=GPU_BASE, env={"MEGASSM_KERNELS": "torch"}, timeout=600)


@pytest.mark.parametrize("n", [2, 4], ids=["tp2", "tp4"])
def test_nccl_torchrun_tp_matches_single_gpu(tmp_path, n):
    _need(n)
    one = _train(tmp_path / "one", 1)
    par = _train(tmp_path / "par", n, [f"parallel.tp={n}", "parallel.sp=true"])
    assert all(abs(par[s] - one[s]) <= 1e-4 * abs(one[s]) for s in one), (par, one)
