"""The data-parallel engines over NCCL on 2 GPUs (`pytest -m gpu`; device kind nvidia-h200-x2): DP=2 equals
one GPU with doubled accumulation (fp32, reference kernels), and bf16 with the Triton kernels trains under
every engine. FSDP2 x TP 2 (TP 2 x FSDP2 over DP 2, with and without SP) on 4 GPUs the same way (nvidia-h100-x4).
Skipped with fewer than 2 GPUs (4 for FSDP2 x TP); the DeepSpeed cases also without DeepSpeed.

    pytest -m gpu tests/test_parallel_engines_gpu.py
"""
import os

import pytest
import torch

from multiproc import train_losses


pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = {
    "ddp": ["parallel.engine=ddp"],
    "ddp_zero1": ["parallel.engine=ddp", "parallel.zero_stage=1"],
    "fsdp2": ["parallel.engine=fsdp2"],
    "zero1": ["parallel.engine=deepspeed", "parallel.zero_stage=1"],
    "zero2": ["parallel.engine=deepspeed", "parallel.zero_stage=2"],
    "zero3": ["parallel.engine=deepspeed", "parallel.zero_stage=3"],
}


def _need(name):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    if "deepspeed" in ENGINES[name][0]:
        pytest.importorskip("deepspeed")


GPU_BASE = ["train.steps=4", "train.log_interval=1", "train.eval_interval=0",
            "train.micro_batch=2", "train.global_batch=8", "train.device=cuda", "run.progress=false",
            "run.tensorboard=false", "run.save_interval=2"]


def _train(run_dir, nproc, extra=(), kernels="torch"):
    return train_losses(run_dir, nproc, extra, base=GPU_BASE, env={"MEGASSM_KERNELS": kernels}, timeout=600)


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """One GPU in fp32 (reference kernels) and DDP on 2 GPUs in bf16 (Triton kernels), shared by the cases."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    base = tmp_path_factory.mktemp("engines-gpu")
    return (_train(base / "one", 1, ["train.precision=fp32"]),
            _train(base / "ddp-bf16", 2, ["train.precision=bf16"], kernels="auto"))


@pytest.mark.parametrize("name", list(ENGINES))
def test_nccl_engine_fp32_matches_single_gpu(tmp_path, refs, name):
    _need(name)
    one = refs[0]
    par = _train(tmp_path / "par", 2, ["train.precision=fp32", *ENGINES[name]])
    assert sorted(par) == sorted(one) and all(abs(par[s] - one[s]) <= 1e-4 * abs(one[s]) for s in one), (par, one)


@pytest.mark.parametrize("name", [n for n in ENGINES if n != "ddp"])
def test_nccl_engine_bf16_triton_trains_and_resumes(tmp_path, refs, name):
    """bf16 autocast, Triton kernels: the losses follow DDP's (DeepSpeed keeps bf16 weights, so within 2%),
    and a resume from the step-2 checkpoint gives the same steps 3-4 as the uninterrupted run."""
    _need(name)
    ref = refs[1]
    got = _train(tmp_path / name, 2, ["train.precision=bf16", *ENGINES[name]], kernels="auto")
    tol = 2e-2 if "deepspeed" in ENGINES[name][0] else 2e-3
    assert all(abs(got[s] - ref[s]) <= tol * abs(ref[s]) for s in ref), (got, ref)
    again = _train(tmp_path / "again", 2, ["train.precision=bf16", *ENGINES[name],
                                            f"run.resume={tmp_path / name}/checkpoints/step_00000002"], kernels="auto")
    assert all(abs(again[s] - got[s]) <= 2e-3 * abs(got[s]) for s in (3, 4)), (again, got)


def test_nccl_distopt_under_cuda_graphs(tmp_path, refs):
    """The distributed optimizer under train.cuda_graph on 2 GPUs (one captured graph adding into its gradient
    buffer, the reduce-scatters after the replays), bf16 + Triton: the losses follow DDP's eager 2-GPU run."""
    _need("ddp_zero1")
    ref = refs[1]
    got = _train(tmp_path / "graph", 2, ["train.precision=bf16", *ENGINES["ddp_zero1"], "train.cuda_graph=true"],
                 kernels="auto")
    assert all(abs(got[s] - ref[s]) <= 2e-3 * abs(ref[s]) for s in ref), (got, ref)


FSDP2_TP = {
    "fsdp2_tp2": ["parallel.engine=fsdp2", "parallel.tp=2"],
    "fsdp2_tp2_sp": ["parallel.engine=fsdp2", "parallel.tp=2", "parallel.sp=true"],
}


@pytest.mark.parametrize("name", list(FSDP2_TP))
def test_nccl_fsdp2_tp2_on_4_gpus(tmp_path, refs, name):
    """TP 2 x FSDP2 over DP 2 on 4 GPUs, same global batch (accumulation 2): fp32 with the reference kernels equals
    one GPU (1e-4); bf16 with the Triton kernels (bf16 all-gathers, fp32 reduce-scatters) follows DDP's 2-GPU bf16
    run (2e-3), and a resume from its step-2 checkpoint gives the same steps 3-4 (2e-3)."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 CUDA GPUs")
    one, ddp_bf16 = refs
    par = _train(tmp_path / "fp32", 4, ["train.precision=fp32", *FSDP2_TP[name]])
    assert sorted(par) == sorted(one) and all(abs(par[s] - one[s]) <= 1e-4 * abs(one[s]) for s in one), (par, one)
    got = _train(tmp_path / name, 4, ["train.precision=bf16", *FSDP2_TP[name]], kernels="auto")
    assert all(abs(got[s] - ddp_bf16[s]) <= 2e-3 * abs(ddp_bf16[s]) for s in ddp_bf16), (got, ddp_bf16)
    again = _train(tmp_path / "again", 4, ["train.precision=bf16", *FSDP2_TP[name],
                                            f"run.resume={tmp_path / name}/checkpoints/step_00000002"], kernels="auto")
    assert all(abs(again[s] - got[s]) <= 2e-3 * abs(got[s]) for s in (3, 4)), (again, got)
