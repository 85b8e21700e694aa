"""`torchrun -m megassm.train ... parallel.tp=N` on CPU (gloo): losses equal the single-process run, and
checkpoints are canonical: saved at TP=2, resumed at TP=1 and at TP=4 (+SP) with the same next-step loss."""
import os
from functools import partial

import pytest
import torch

from conftest import use_megatron_groups
from multiproc import train_losses


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=64", "model.mamba.d_state=16",
    "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.attn.n_heads=4", "model.attn.n_kv_heads=2",
    "model.mlp.ffn_hidden=128", "train.seq_len=48", "train.micro_batch=2", "train.global_batch=4",
    "train.log_interval=1", "train.eval_interval=0", "optim.warmup_steps=2", "optim.lr=3e-3",
    "run.progress=false", "run.tensorboard=false", "train.steps=4", "run.save_interval=2", "train.device=cpu",
]


_run = partial(train_losses, base=TINY)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp-train")
    single = _run(base / "single")
    tp2 = _run(base / "tp2", nproc=2, extra=["parallel.tp=2"])
    return base, single, tp2


def _close(a, b, rel=1e-5):
    return abs(a - b) <= rel * abs(b)


def test_torchrun_tp2_matches_single_process(runs):
    _, single, tp2 = runs
    assert sorted(tp2) == [1, 2, 3, 4]
    assert all(_close(tp2[s], single[s]) for s in single), (tp2, single)


def test_checkpoint_is_canonical(runs):
    from megassm.config import load_config
    from megassm.models import build_model

    base, _, _ = runs
    state = torch.load(base / "tp2" / "checkpoints" / "step_00000002" / "model.pt", weights_only=True)
    cfg = load_config(None, TINY)
    model = build_model(cfg.model, vocab_size=257)
    model.load_state_dict(state, strict=True)  # single-device shapes
    optim = torch.load(base / "tp2" / "checkpoints" / "step_00000002" / "optim.pt", weights_only=True)
    params = [p for g in model.param_groups(0.1) for p in g["params"]]  # the optimizer's order
    for idx, st in optim["state"].items():
        assert st["exp_avg"].shape == params[idx].shape


@pytest.mark.parametrize("nproc,extra", [(1, []), (4, ["parallel.tp=4", "parallel.sp=true"])],
                         ids=["resume-tp1", "resume-tp4-sp"])
def test_resume_tp2_checkpoint_at_other_tp(runs, tmp_path, nproc, extra):
    base, single, _ = runs
    resumed = _run(tmp_path / "r", nproc=nproc, extra=extra, resume=base / "tp2" / "checkpoints" / "step_00000002")
    assert sorted(resumed) == [3, 4]
    assert all(_close(resumed[s], single[s]) for s in resumed), (resumed, single)


def test_torchrun_tp2_dp2_matches_single_process(runs, tmp_path, monkeypatch):
    use_megatron_groups(monkeypatch)  # the trainer end to end with megatron-core's groups
    _, single, _ = runs
    both = _run(tmp_path / "tpdp", nproc=4, extra=["parallel.tp=2"])
    assert all(_close(both[s], single[s]) for s in single), (both, single)
