"""The fused cross-entropy (kernels/loss/triton_ce.py) against the PyTorch reference F.cross_entropy(logits.float()):
per-row losses and the logits' gradient, fp32 and bf16, vocabularies below, at and past one tile (the online
log-sum-exp across tiles), ignored rows, strided rows, labels out of range; and the model's loss through it.
Triton's CPU interpreter at small shapes in CI; `-m gpu` runs the LM-head shape on the device."""
import pytest
import torch
import torch.nn.functional as F

# kernel_cases sets TRITON_INTERPRET before the Triton kernels are first imported
from kernel_cases import DEV, HAS_CUDA, K, TRITON_WARNINGS, gpu, needs_cuda, needs_triton
from kernel_cases import triton_mode  # noqa: F401  (fixture)

pytestmark = TRITON_WARNINGS


def _case(n, v, dtype, seed=0, ignore=(), scale=4.0, wider=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v + wider, generator=g) * scale)[:, :v].to(dtype).to(DEV)  # wider: strided rows
    labels = torch.randint(0, v, (n,), generator=g)
    for r in ignore:
        labels[r] = -100
    return x, labels.to(DEV), torch.randn(n, generator=g).to(DEV)


def _both(x, labels, gl):
    out = []
    for fn in (lambda a: K.cross_entropy(a, labels),
               lambda a: F.cross_entropy(a.float(), labels, ignore_index=-100, reduction="none")):
        leaf = x.detach().clone().requires_grad_(True)
        loss = fn(leaf)
        (dx,) = torch.autograd.grad(loss, leaf, gl)
        out.append((loss, dx))
    return out


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,v,wider", [(5, 37, 0), (3, 4096, 0), (4, 9001, 3), (2, 1, 0)])
def test_cross_entropy_against_reference(triton_mode, dtype, n, v, wider):
    x, labels, gl = _case(n, v, dtype, ignore=(1,) if n > 2 else (), wider=wider)
    (loss, dx), (ref_loss, ref_dx) = _both(x, labels, gl)
    assert loss.dtype == torch.float32 and dx.dtype == dtype and dx.shape == x.shape
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    if n > 2:
        assert loss[1] == 0 and torch.all(dx[1] == 0)  # the ignored row: no loss, no gradient
    # the gradient: fp32 math, one rounding to the logits' dtype (bf16: one ulp of the largest entry, ~1)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=2 ** -7)
    torch.testing.assert_close(dx.float(), ref_dx.float(), **tol)


@needs_triton
def test_cross_entropy_extreme_logits_and_all_ignored(triton_mode):
    """-inf logits (masked vocabulary entries), large ones (no overflow: the online max), every row ignored."""
    x, labels, gl = _case(3, 5000, torch.float32, scale=1.0)
    x[0, 100:4200] = float("-inf")
    x[1, 7] = 1e4
    labels[0] = 3
    (loss, dx), (ref_loss, ref_dx) = _both(x, labels, gl)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
    ignored = torch.full((3,), -100, device=DEV)
    (loss, dx), _ = _both(x, ignored, gl)
    assert torch.all(loss == 0) and torch.all(dx == 0)


@needs_triton
def test_cross_entropy_label_out_of_range_is_nan(triton_mode):
    """F.cross_entropy raises a device assert; the kernel marks the row NaN (the trainer stops on a NaN loss)."""
    x, labels, _ = _case(3, 40, torch.float32)
    labels[2] = 40
    loss = K.cross_entropy(x, labels)
    assert torch.isnan(loss[2]) and torch.isfinite(loss[:2]).all()


def test_cross_entropy_bad_shapes():
    with pytest.raises(ValueError, match=r"logits \(2, 3, 4\) must be \[N, V\]"):
        K.cross_entropy(torch.randn(2, 3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must be integers"):
        K.cross_entropy(torch.randn(2, 4), torch.zeros(2))


@needs_triton
def test_model_loss_through_the_fused_kernel(triton_mode):
    """The LM's loss and its gradients with the Triton loss equal the reference loss's (bf16 logits)."""
    from megassm.config import MambaConfig, ModelConfig
    from megassm.models.lm import build_model

    cfg = ModelConfig(pattern="M", d_model=32, vocab_size=300, tie_embeddings=True,
                      mamba=MambaConfig(d_state=8, d_conv=4, expand=2, headdim=16, ngroups=1, chunk_size=8))
    model = build_model(cfg).to(DEV)
    tokens = torch.randint(0, 300, (2, 16), device=DEV)
    labels = tokens.roll(-1, 1)
    labels[0, :5] = -100
    h = model.embedding(tokens).detach().to(torch.bfloat16)
    w = model.embedding.weight.detach().to(torch.bfloat16).requires_grad_(True)
    logits = F.linear(h, w)
    fused = model.loss_fn(logits, labels)
    (g_fused,) = torch.autograd.grad(fused, w, retain_graph=True)
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)
    (g_ref,) = torch.autograd.grad(ref, w)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_fused.float(), g_ref.float(), rtol=2e-2, atol=2e-3)


@gpu
@needs_cuda
def test_cross_entropy_lm_head_shape_on_gpu(monkeypatch):
    """8192 rows x 50304 (mamba2-1.3b's padded vocabulary), bf16: losses and gradient against the reference."""
    assert HAS_CUDA
    monkeypatch.setenv("MEGASSM_KERNELS", "triton")
    x, labels, gl = _case(8192, 50304, torch.bfloat16, ignore=(0, 4000))
    (loss, dx), (ref_loss, ref_dx) = _both(x, labels, gl)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dx.float(), ref_dx.float(), rtol=0, atol=2 ** -7)
