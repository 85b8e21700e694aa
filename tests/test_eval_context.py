"""megassm-eval: perplexity by context length, streaming held-out documents with carried state."""
import json
import os

import numpy as np
import torch
import torch.nn.functional as F

from megassm.config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig, load_config
from megassm.evaluation.context import bucketize, default_edges, position_losses
from megassm.models import build_model


def test_streamed_position_losses_equal_full_forward():
    cfg = ModelConfig(pattern="M*M-", d_model=32, mamba=MambaConfig(d_state=8, headdim=8, chunk_size=4),
                      attn=AttentionConfig(n_heads=2, sliding_window=6), mlp=MLPConfig(ffn_hidden=48))
    model = build_model(cfg, vocab_size=50)
    model.init_weights(1)
    model.eval()
    g = np.random.default_rng(0)
    docs = [g.integers(0, 50, n) for n in (41, 23, 9)]
    loss_sum, count = position_losses(model, docs, window=8, batch_size=2)
    ref_sum = np.zeros_like(loss_sum)
    ref_cnt = np.zeros_like(count)
    with torch.no_grad():
        for d in docs:
            t = torch.from_numpy(d)[None]
            logits = model(t[:, :-1]).logits[0]
            ce = F.cross_entropy(logits, t[0, 1:], reduction="none").double().numpy()
            ref_sum[: len(ce)] += ce
            ref_cnt[: len(ce)] += 1
    assert np.array_equal(count, ref_cnt)
    np.testing.assert_allclose(loss_sum, ref_sum, rtol=1e-5, atol=1e-5)
    b = bucketize(loss_sum, count, [0, 4, 8, 16, 64])
    assert [r["tokens"] for r in b] == [12, 12, 16, 30] and b[-1]["end"] == 40
    assert default_edges(40, 8) == [0, 4, 8, 16, 32, 64]
    assert default_edges(20000, 2048)[:4] == [0, 512, 1024, 2048]


def test_megassm_eval_on_a_tiny_trained_checkpoint(tmp_path):
    from megassm.evaluation.cli import main
    from megassm.training.trainer import Trainer

    run = tmp_path / "run"
    cfg = load_config(None, [
        "data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=32", "model.mamba.d_state=8",
        "model.mamba.headdim=8", "model.mamba.chunk_size=8", "model.attn.n_heads=2", "model.attn.sliding_window=16",
        "model.mlp.ffn_hidden=64", "train.seq_len=32", "train.micro_batch=4", "train.global_batch=4",
        "train.bptt=true", "train.steps=4", "train.eval_interval=0", "run.progress=false", "run.tensorboard=false",
        "data.prefetch=0", f"run.dir={run}",
    ])
    Trainer(cfg).fit()
    rc = main(["context", "--run", str(run), "--max-tokens", "256", "--docs", "3", "--batch-size", "2"])
    assert rc == 0
    out = run / "eval"
    res = json.load(open(out / "context_step_00000004.json"))
    assert res["step"] == 4 and res["window"] == 32 and res["num_docs"] == 3
    assert res["carried"] == ["mamba", "window", "mamba", None]
    # every document of the split is either evaluated or counted as skipped, with its reason
    in_split = int(res["documents"].split("(")[1].split(" in it")[0])
    assert res["num_docs"] + sum(res["skipped_docs"].values()) == in_split
    assert res["skipped_docs"]["beyond --docs 3 (shorter ones)"] > 0
    b = res["buckets"]
    assert [r["start"] for r in b] == [0, 16, 32, 64, 128] and sum(r["tokens"] for r in b) == res["tokens"]
    # the first window is the same computation with or without carrying; later ones are not
    assert b[0]["loss"] == b[0]["loss_window_reset"] and b[1]["loss"] == b[1]["loss_window_reset"]
    assert b[-1]["loss"] != b[-1]["loss_window_reset"]
    md = open(out / "context_step_00000004.md").read()
    assert "| positions |" in md and "Skipped: " in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert os.path.getsize(out / "context_step_00000004.png") > 1000
