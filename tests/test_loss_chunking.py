"""train.loss_chunk_tokens: the LM head + cross-entropy over checkpointed chunks of the sequence equals the
whole-sequence loss (value and every gradient; fp32 and bf16 autocast; chunks that do not divide the
length; ignored labels), and trains identically under TP + SP and PP over gloo."""
import os
from functools import partial

import pytest
import torch

from megassm.config import ConfigError, load_config
from megassm.models import build_model

from multiproc import train_losses
from parallel_cases import make_batch, tiny_model_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _loss_and_grads(model, batch, chunk, autocast, device_type="cpu"):
    model.zero_grad(set_to_none=True)
    model.loss_chunk_tokens = chunk
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(batch["tokens"], seq_idx=batch["seq_idx"], labels=batch["labels"]).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunk", [7, 24, 1])
def test_chunked_loss_equals_whole_loss_fp32(chunk, tie):
    model = build_model(tiny_model_config("M*M-", tie=tie), vocab_size=100)
    model.init_weights(0)
    batch = make_batch(100, 2, 29)  # 58 tokens: chunks of 3, 12 and 1 row positions, the last one short
    batch["labels"][1, 10:20] = -100
    ref, ref_g = _loss_and_grads(model, batch, 0, False)
    got, got_g = _loss_and_grads(model, batch, chunk, False)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    for n in ref_g:
        torch.testing.assert_close(got_g[n], ref_g[n], rtol=1e-5, atol=1e-7, msg=n)


def test_chunked_loss_bf16_autocast_within_bf16_rounding():
    model = build_model(tiny_model_config("M-"), vocab_size=100)
    model.init_weights(0)
    batch = make_batch(100, 2, 40)
    ref, ref_g = _loss_and_grads(model, batch, 0, True)
    got, got_g = _loss_and_grads(model, batch, 16, True)
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=0)
    for n in ref_g:
        rel = float((got_g[n] - ref_g[n]).norm() / ref_g[n].norm().clamp(min=1e-12))
        assert rel < 2e-2, (n, rel)


def test_all_labels_ignored_gives_zero_loss():
    model = build_model(tiny_model_config("M-"), vocab_size=100)
    model.init_weights(0)
    batch = make_batch(100, 2, 20)
    batch["labels"][:] = -100
    loss, _ = _loss_and_grads(model, batch, 8, False)
    assert float(loss) == 0.0


def test_refusals():
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens must be >= 0"):
        load_config(None, ["data.builtin=stdlib", "train.loss_chunk_tokens=-1"])


TINY = [
    "data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=64", "model.mamba.d_state=16",
    "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.attn.n_heads=4", "model.attn.n_kv_heads=2",
    "model.mlp.ffn_hidden=128", "train.seq_len=40", "train.micro_batch=2", "train.global_batch=4",
    "train.log_interval=1", "train.eval_interval=0", "optim.warmup_steps=2", "optim.lr=3e-3",
    "run.progress=false", "run.tensorboard=false", "train.steps=3", "run.save_final=false", "train.device=cpu",
]


_run = partial(train_losses, base=TINY, timeout=400)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("chunked") / "one", 1)


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.sp=true"], ["parallel.pp=2"]], ids=["tp2-sp", "pp2"])
def test_chunked_loss_trains_like_the_single_process(layout, single, tmp_path):
    """Chunks of 24 tokens (12 positions of the 2 rows; a 20-token SP piece cut 12 + 8, PP's 40 cut
    12 + 12 + 12 + 4, the head then running in the schedule's loss function) on 2 ranks give the single
    process's unchunked losses. (TP + SP x CP with chunks: tests/test_parallel_cp.py.)"""
    ref = single
    got = _run(tmp_path / "par", 2, [*layout, "train.loss_chunk_tokens=24"])
    assert sorted(got) == sorted(ref) and all(abs(got[s] - ref[s]) <= 2e-5 * abs(ref[s]) for s in ref), (got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_chunked_loss_on_gpu(autocast):
    """Real-ish shapes on CUDA with the Triton kernels: 2 x 1024 tokens, vocabulary 32000, chunks of 700."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    model = build_model(tiny_model_config("M-M-", big=True), vocab_size=32000)
    model.init_weights(0)
    model = model.cuda()
    batch = make_batch(32000, 2, 1024, device="cuda")

    ref, ref_g = _loss_and_grads(model, batch, 0, autocast, "cuda")
    got, got_g = _loss_and_grads(model, batch, 700, autocast, "cuda")
    torch.testing.assert_close(got, ref, rtol=2e-3 if autocast else 1e-5, atol=0)
    for n in ref_g:
        rel = float((got_g[n] - ref_g[n]).norm() / ref_g[n].norm().clamp(min=1e-12))
        assert rel < (2e-2 if autocast else 1e-4), (n, rel)
