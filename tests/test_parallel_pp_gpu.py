"""The pipeline-parallel checks over NCCL on 2 and 4 GPUs (`pytest -m gpu`; device kinds nvidia-h200-x2 /
nvidia-h200-x4). Skipped when fewer GPUs are visible.

    pytest -m gpu tests/test_parallel_pp_gpu.py -k "pp2 and not tp2 and not dp2"   # 2 GPUs
    pytest -m gpu tests/test_parallel_pp_gpu.py                                     # 4 GPUs: everything
"""
import json
import os
from functools import partial

import pytest
import torch

from multiproc import spawn, train_losses
from pp_cases import pp_equivalence_worker


pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = [
    dict(model=dict(pattern="MMMM"), n_micro=4),
    dict(model=dict(pattern="M*|M-", tie=False), n_micro=3),
    dict(model=dict(pattern="MM*M-M", ngroups=2), virtual=2, n_micro=4),
]
CASES_TP = [
    dict(model=dict(pattern="M*|M-", tie=False, ngroups=1), n_micro=3),
    dict(model=dict(pattern="MM*M", ngroups=2), sp=True, n_micro=4),
]
CASES_PP4 = [  # four stages: two middle stages that neither embed nor compute the loss (a '|' cut must give 4)
    dict(model=dict(pattern="MMMM"), n_micro=4),
    dict(model=dict(pattern="M*|M-|MM|M-", tie=False), n_micro=4),
]
BIG = [dict(model=dict(pattern="M*M-", ngroups=1, n_kv_heads=4, big=True), n_micro=4, seqlen=256),
       dict(model=dict(pattern="MM|MM", ngroups=8, big=True), n_micro=2, seqlen=256)]
LAYOUTS = {"pp2": (2, 1, 2), "pp2-tp2": (4, 2, 2), "pp2-dp2": (4, 1, 2), "pp4": (4, 1, 4)}  # world, tp, pp


def _need(n):
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nccl_pp_exact_reference_kernels(tmp_path, monkeypatch, layout):
    """PP logic over NCCL with the PyTorch reference kernels (fp32, TF32 off): 1e-5 like on gloo."""
    world, tp, pp = LAYOUTS[layout]
    _need(world)
    monkeypatch.setenv("MEGASSM_KERNELS", "torch")
    out = tmp_path / "r.json"
    cases = CASES_TP if tp > 1 else CASES_PP4 if pp == 4 else CASES
    spawn(pp_equivalence_worker, world, tp, pp, [dict(c) for c in cases], str(out), "cuda", backend="nccl")
    assert len(json.loads(out.read_text())) == len(cases)


@pytest.mark.parametrize("layout", ["pp2", "pp2-tp2"])
def test_nccl_pp_triton_real_shapes(tmp_path, monkeypatch, layout):
    """d_model 1024, 32k vocab, seq 256 with the Triton kernels (tl.dot may use TF32): 2e-3 relative."""
    world, tp, pp = LAYOUTS[layout]
    _need(world)
    monkeypatch.setenv("MEGASSM_KERNELS", "auto")
    out = tmp_path / "r.json"
    spawn(pp_equivalence_worker, world, tp, pp, [dict(c) for c in BIG], str(out), "cuda", 2e-3, backend="nccl")


GPU_BASE = ["train.steps=4", "train.log_interval=1", "train.eval_interval=2",
            "train.micro_batch=2", "train.global_batch=8", "train.precision=fp32", "train.device=cuda",
            "run.progress=false", "run.tensorboard=false"]
_train = partial(train_losses, base=GPU_BASE, env={"MEGASSM_KERNELS": "torch"}, timeout=600)


@pytest.mark.parametrize("n,extra", [(2, ["parallel.pp=2"]),
                                     (4, ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true"]),
                                     (4, ["parallel.pp=2", "parallel.pp_virtual=2"])],
                         ids=["pp2", "pp2-tp2-sp", "pp2-virtual2-dp2"])
def test_nccl_torchrun_pp_matches_single_gpu(tmp_path, n, extra):
    _need(n)
    one = _train(tmp_path / "one", 1)
    par = _train(tmp_path / "par", n, extra)
    assert sorted(par) == sorted(one)
    assert all(abs(par[s] - one[s]) <= 1e-4 * abs(one[s]) for s in one), (par, one)
