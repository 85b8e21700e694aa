"""The shared pieces of the reliability tests (tests/test_reliability*.py): a small run through megassm-train's
main() on the tiny config, its exit record, bytes flipped on disk, and a 4-step base run to copy."""
import json
import os
import shutil

import pytest
import torch

from megassm import train as T
from megassm.training import checkpoint as ckpt
from megassm.training.failures import EXIT_OK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["model.pattern=M*M-", "model.d_model=32", "model.mamba.d_state=8", "model.mamba.headdim=16",
         "model.mamba.chunk_size=16", "model.attn.n_heads=2", "model.attn.n_kv_heads=1", "model.mlp.ffn_hidden=64",
         "train.seq_len=32", "train.micro_batch=2", "train.global_batch=4", "train.log_interval=1",
         "train.eval_interval=0", "optim.warmup_steps=1", "run.progress=false", "run.tensorboard=false",
         "train.device=cpu"]


def run_main(run_dir, *extra, resume=None):
    args = ["--config", "configs/tiny.yaml", *SMALL, f"run.dir={run_dir}", *extra]
    return T.main(args + (["--resume", resume] if resume else []))  # --resume after the overrides


def last_exit(run_dir):
    with open(os.path.join(run_dir, "last_exit.json")) as f:
        return json.load(f)


def flip_bytes(path, n=8):
    b = bytearray(open(path, "rb").read())
    mid = len(b) // 2
    b[mid:mid + n] = bytes(x ^ 0xFF for x in b[mid:mid + n])
    open(path, "wb").write(b)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4; tests copy it."""
    run = str(tmp_path_factory.mktemp("base") / "run")
    assert run_main(run, "train.steps=4", "run.save_interval=2") == EXIT_OK
    return run


def copy_run(base_run, tmp_path):
    dst = str(tmp_path / "run")
    shutil.copytree(base_run, dst)
    return dst


def small_model_ckpt(tmp_path, step=1, nan=False):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    if nan:
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
    return model, opt, ckpt.save_checkpoint(tmp_path, step, model=model, optimizer=opt,
                                            extra={"rng": ckpt.capture_rng_state(), "consumed_tokens": 3})
