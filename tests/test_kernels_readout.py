"""The CP state read-out's Triton kernels (kernels/mamba2_ssd/triton_readout.py: out = y + w (C . h), and dC, dh, dw)
against its torch path, fp32 and bf16, a slice length that is not a multiple of the kernels' token block,
2 groups of 2 heads, a reset inside the slice (w = 0 after it), C as a strided view (the conv output's
columns). In the CPU interpreter on CI, natively on a machine with CUDA."""
import pytest
import torch

# kernel_cases sets TRITON_INTERPRET before the Triton kernels are first imported
from kernel_cases import DEV, TRITON_WARNINGS, needs_triton
from kernel_cases import triton_mode  # noqa: F401  (fixture)

pytestmark = TRITON_WARNINGS


def _case(dtype, L=70, G=2, H=4, P=16, N=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    Bz = 2
    y = torch.randn(Bz, L, H, P, generator=g).to(DEV, dtype)
    xbc = torch.randn(Bz, L, 3 * G * N, generator=g).to(DEV, dtype)
    C = xbc[..., G * N:2 * G * N].unflatten(-1, (G, N))  # strided, as cp.py gets it
    h = torch.randn(Bz, H, P, N, generator=g).to(DEV)
    cs = (-torch.rand(Bz, L, H, generator=g) * 0.05).cumsum(1).to(DEV)
    w = torch.exp(cs)
    w[0, 40:] = 0  # a reset inside the slice
    dout = torch.randn(Bz, L, H, P, generator=g).to(DEV, dtype)
    return y, C, h, w, dout


def _run(y, C, h, w, dout):
    from megassm.kernels.mamba2_ssd.readout import state_readout_add

    leaves = [t.detach().clone().requires_grad_(True) for t in (y, C, h, w)]
    out = state_readout_add(*leaves)
    out.backward(dout)
    return out.detach(), *(t.grad for t in leaves)


@needs_triton
@pytest.mark.parametrize("split", ["whole", "partial-sums", "uneven"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_readout_kernels_match_the_torch_path(triton_mode, monkeypatch, dtype, split):
    """partial-sums: one head and one token block per program, so dC and dh are sums of partial results;
    uneven: 3 heads a group, 2 per dC program (the second program of a group takes the one left)."""
    from megassm.kernels.mamba2_ssd import triton_readout as tr

    if split == "partial-sums":
        monkeypatch.setattr(tr, "HEADS_PER_PROGRAM", 1)
        monkeypatch.setattr(tr, "BLOCKS_PER_PROGRAM", 1)
    elif split == "uneven":
        monkeypatch.setattr(tr, "HEADS_PER_PROGRAM", 2)
        monkeypatch.setattr(tr, "BLOCKS_PER_PROGRAM", 1)
    case = _case(dtype, H=6 if split == "uneven" else 4)
    got = _run(*case)
    monkeypatch.setenv("MEGASSM_KERNELS", "torch")
    want = _run(*case)
    for name, a, b in zip(("out", "dy", "dC", "dh", "dw"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
        else:  # bf16 roundings placed differently (the kernels keep h in fp32 and round the sum once)
            assert (a.float() - b.float()).norm() <= 1e-2 * b.float().norm(), name
    assert torch.equal(got[1], case[4])  # dy is dout itself


@needs_triton
def test_readout_kernels_refuse_what_they_cannot_tile(triton_mode):
    from megassm.kernels.mamba2_ssd import triton_readout as tk

    y, C, h, w, _ = _case(torch.float32, P=16, N=16)
    assert tk.supported(y, C)
    assert not tk.supported(y[..., :12], C)  # P not a power of two >= 16: the torch path runs
    with pytest.raises(ValueError, match="h contiguous fp32"):
        tk.readout_fwd(y, C, h.double(), w)
