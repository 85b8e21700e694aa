"""Validation that does not move with the layout: train.eval_tokens defines the held-out set (whole samples of
the fixed validation order), split over data-parallel ranks and micro-batches with ignored padding rows, and the
loss is the token-weighted mean. The same checkpoint gives the same validation loss at any micro-batch size and
under PP=2, CP=2 and DP=2 (gloo, real processes); train.eval_batches is read as its deprecated alias."""
import json
import logging

import pytest
import torch
import torch.nn.functional as F

from megassm.config import ConfigError, load_config
from multiproc import spawn

CFG = [
    "data.builtin=stdlib", "model.pattern=M*|M-", "model.d_model=32", "model.mamba.d_state=8", "model.mamba.headdim=8",
    "model.mamba.chunk_size=8", "model.attn.n_heads=2", "model.mlp.ffn_hidden=64", "train.seq_len=32",
    "train.micro_batch=2", "train.global_batch=4", "train.steps=2", "train.eval_interval=0",
    "train.eval_tokens=150",  # 5 samples of 32 tokens (rounded up): never a multiple of the micro-batch
    "run.progress=false", "run.tensorboard=false", "data.prefetch=0", "train.device=cpu",
]


def _trainer(run_dir, extra=()):
    from megassm.training.trainer import Trainer

    return Trainer(load_config(None, CFG + [f"run.dir={run_dir}", *extra]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("validation")
    t = _trainer(base / "train")
    t.fit()
    val = t.evaluate()["loss/val"]
    ckpt = t.last_checkpoint
    # the reference: the first 5 validation samples through the single-device model, mean over their tokens
    losses, n = 0.0, 0
    with torch.no_grad():
        for i in range(5):
            s = t.data._valid.sample(i)
            tok = torch.from_numpy(s.tokens)
            logits = t.model(tok[None, :-1]).logits[0].float()
            losses += float(F.cross_entropy(logits, tok[1:], reduction="sum"))
            n += len(tok) - 1
    t.close()
    return base, ckpt, val, losses / n


def test_validation_loss_is_the_token_mean_over_eval_tokens(trained):
    _, _, val, ref = trained
    assert abs(val - ref) <= 1e-5 * ref


@pytest.mark.parametrize("micro", [1, 4])
def test_same_checkpoint_same_validation_loss_at_any_micro_batch(trained, micro):
    base, ckpt, val, _ = trained
    t = _trainer(base / f"mb{micro}", [f"train.micro_batch={micro}", f"run.resume={ckpt}"])
    try:
        assert t.eval_samples() == 5
        got = t.evaluate()["loss/val"]
    finally:
        t.close()
    assert abs(got - val) <= 1e-5 * val, (micro, got, val)


def _layout_worker(rank, world, ckpt, run_dir, out, over):
    t = _trainer(run_dir, [*over, f"run.resume={ckpt}"])
    try:
        v = t.evaluate()["loss/val"]
    finally:
        t.close()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(v, f)


@pytest.mark.parametrize("name,over", [("pp2", ["parallel.pp=2", "train.micro_batch=2"]), ("cp2", ["parallel.cp=2"]),
                                       ("dp2", ["train.micro_batch=1"])])
def test_same_checkpoint_same_validation_loss_under_pp2_cp2_dp2(trained, name, over):
    """PP runs the set through the pipeline schedule; CP splits every sample's tokens over the ranks; DP splits the
    samples (5 over 2 ranks: one padding row). Every rank reports the same value."""
    base, ckpt, val, _ = trained
    out = str(base / f"{name}-val")
    spawn(_layout_worker, 2, ckpt, str(base / name), out, over)
    got = [json.load(open(f"{out}.{r}")) for r in range(2)]
    assert got[0] == got[1]
    assert abs(got[0] - val) <= 1e-5 * val, (got, val)


def test_eval_batches_cover_exactly_the_set_for_any_dp_and_micro_batch(trained):
    from megassm.data_tools.loader import build_data

    cfg = load_config(None, CFG)
    rows = {}
    for dp, micro in ((1, 2), (2, 2), (3, 1), (2, 4)):
        seen, n_batches = [], set()
        for r in range(dp):
            data = build_data(cfg.data, seq_len=32, micro_batch=micro, global_batch=micro * dp, dp_rank=r, dp_size=dp)
            batches = list(data.eval_batches(5))
            n_batches.add(len(batches))
            for b in batches:
                assert b["tokens"].shape == (micro, 32)
                assert int(b["tokens"].min()) >= 0  # padding rows ignore their labels, not their tokens
                for row in range(micro):
                    if (b["labels"][row] != -100).any():
                        assert (b["labels"][row] != -100).all()
                        seen.append(b["tokens"][row])
            data.close()
        assert len(n_batches) == 1  # every rank runs the same number of micro-batches
        rows[(dp, micro)] = torch.stack(seen)
    first = rows[(1, 2)]
    assert first.shape[0] == 5
    for key, r in rows.items():
        assert torch.equal(r, first), key  # the same 5 samples, in order


def test_eval_batches_is_a_deprecated_alias(caplog):
    with caplog.at_level(logging.WARNING, logger="megassm.config"):
        cfg = load_config(None, ["data.builtin=stdlib", "train.eval_batches=3", "train.micro_batch=2",
                                 "train.global_batch=4", "train.seq_len=64"])
    assert cfg.train.eval_tokens == 3 * 2 * 64  # the samples it evaluated in this layout (1 data-parallel rank)
    assert "train.eval_batches=3 is deprecated" in caplog.text and "eval_batches" not in str(cfg.train)
    with pytest.raises(ConfigError, match="train.eval_batches is deprecated and train.eval_tokens is set too"):
        load_config(None, ["data.builtin=stdlib", "train.eval_batches=3", "train.eval_tokens=100"])
