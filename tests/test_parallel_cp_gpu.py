"""The context-parallel checks over NCCL on 2 and 4 GPUs (`pytest -m gpu`; device kinds nvidia-h200-x2 /
nvidia-h200-x4). Skipped when fewer GPUs are visible.

    pytest -m gpu tests/test_parallel_cp_gpu.py -k "cp2"      # 2 GPUs
    pytest -m gpu tests/test_parallel_cp_gpu.py               # 4 GPUs: everything
"""
import json
import os
from functools import partial

import pytest
import torch

from cp_cases import cp_equivalence_worker
from multiproc import spawn, train_losses


pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = [
    dict(pattern="MM", ngroups=2),
    dict(pattern="M*M-", tie=False),
    dict(pattern="M*M-", window=9, n_kv_heads=1),
]
# d_model 1024, N=128, P=64, chunk 128, 16 attention heads; 448 tokens: 224 / 112 per rank (chunks cut
# inside a slice and slices shorter than a chunk), a window reaching over a rank boundary
BIG = [dict(pattern="MM", ngroups=8, big=True), dict(pattern="M*M-", ngroups=1, n_kv_heads=4, window=160, big=True)]


def _need(n):
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs")


@pytest.mark.parametrize("cp,tp", [(2, 1), (4, 1), (2, 2)], ids=["cp2", "cp4", "tp2-cp2"])
def test_nccl_cp_exact_reference_kernels(tmp_path, monkeypatch, cp, tp):
    """CP logic over NCCL with the PyTorch reference kernels (fp32, TF32 off): 1e-5 like on gloo."""
    _need(cp * tp)
    monkeypatch.setenv("MEGASSM_KERNELS", "torch")
    out = tmp_path / "r.json"
    spawn(cp_equivalence_worker, cp * tp, cp, tp, [dict(c) for c in CASES], str(out), "cuda", backend="nccl")
    assert len(json.loads(out.read_text())) == len(CASES)


@pytest.mark.parametrize("cp", [2, 4], ids=["cp2", "cp4"])
def test_nccl_cp_triton_real_shapes(tmp_path, monkeypatch, cp):
    """Real shapes with the Triton kernels (tl.dot may use TF32): 2e-3 relative."""
    _need(cp)
    monkeypatch.setenv("MEGASSM_KERNELS", "auto")
    out = tmp_path / "r.json"
    spawn(cp_equivalence_worker, cp, cp, 1, [dict(c) for c in BIG], str(out), "cuda", 2e-3, 448, backend="nccl")
    assert len(json.loads(out.read_text())) == len(BIG)


GPU_BASE = ["train.steps=4", "train.log_interval=1", "train.eval_interval=0",
            "train.precision=fp32", "train.device=cuda", "run.progress=false", "run.tensorboard=false"]
_train = partial(train_losses, base=GPU_BASE, env={"MEGASSM_KERNELS": "torch"}, timeout=600)


@pytest.mark.parametrize("n", [2, 4], ids=["cp2", "cp4"])
def test_nccl_torchrun_cp_matches_single_gpu(tmp_path, n):
    _need(n)
    one = _train(tmp_path / "one", 1)
    par = _train(tmp_path / "par", n, [f"parallel.cp={n}"])
    assert all(abs(par[s] - one[s]) <= 1e-4 * abs(one[s]) for s in one), (par, one)
