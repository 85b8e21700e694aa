"""FLOP counting per layer type (megassm.training.flops), cross-checked against independent counts:
parameters of plain nn.Linear stacks, torch's FlopCounterMode, and explicit causal masks."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from megassm.config import ModelConfig, load_config
from megassm.training import flops as fl

L = 40  # not a multiple of the chunk size: a partial last chunk


def tiny(pattern="M*M-", **kw):
    overrides = [f"model.pattern={pattern}", "model.d_model=32", "model.mamba.d_state=8", "model.mamba.headdim=16",
                 "model.mamba.ngroups=2", "model.mamba.chunk_size=16", "model.attn.n_heads=4",
                 "model.attn.n_kv_heads=2", "model.mlp.ffn_hidden=48", "data.builtin=stdlib"]
    overrides += [f"{k}={v}" for k, v in kw.items()]
    return load_config(None, overrides).model


def linears(m: ModelConfig) -> dict:
    """The projection layers of each block type, rebuilt here from plain nn.Linear (no bias)."""
    d = m.d_model
    di = m.mamba.expand * d
    gn = m.mamba.ngroups * m.mamba.d_state
    H = di // m.mamba.headdim
    hd = d // m.attn.n_heads
    nkv = m.attn.n_kv_heads
    f = m.mlp.ffn_hidden
    lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
    return {
        "M": nn.ModuleList([lin(d, 2 * di + 2 * gn + H), lin(di, d)]),
        "*": nn.ModuleList([lin(d, m.attn.n_heads * hd), lin(d, nkv * hd), lin(d, nkv * hd), lin(m.attn.n_heads * hd, d)]),
        "-": nn.ModuleList([lin(d, f), lin(d, f), lin(f, d)]),
    }


def n_params(mod):
    return sum(p.numel() for p in mod.parameters())


def test_projection_terms_are_twice_the_parameters_per_token():
    m = tiny()
    vocab = 384
    out = fl.flops_per_sequence(m, vocab, L)
    lin = linears(m)
    n_m, n_a, n_f = m.pattern.count("M"), m.pattern.count("*"), m.pattern.count("-")
    assert out["mamba_proj"] == 2 * L * n_params(lin["M"]) * n_m
    assert out["attn_proj"] == 2 * L * n_params(lin["*"]) * n_a
    assert out["mlp"] == 2 * L * n_params(lin["-"]) * n_f
    assert out["head"] == 2 * L * m.d_model * vocab
    assert out["embedding"] == 0
    assert out["total"] == sum(v for k, v in out.items() if k != "total")
    assert set(out) == set(fl.FLOP_KEYS) | {"total"}

    # and torch's own counter agrees on the matmuls
    x = torch.randn(1, L, m.d_model)
    with FlopCounterMode(display=False) as fc:
        h = lin["M"][0](x)
        lin["M"][1](h[..., : m.mamba.expand * m.d_model])
    assert fc.get_total_flops() == out["mamba_proj"] // n_m


def test_mamba_conv_term():
    m = tiny("M")
    di, gn = 2 * m.d_model, m.mamba.ngroups * m.mamba.d_state
    conv_dim = di + 2 * gn
    conv = nn.Conv1d(conv_dim, conv_dim, m.mamba.d_conv, groups=conv_dim, bias=False, padding=m.mamba.d_conv - 1)
    with FlopCounterMode(display=False) as fc:
        conv(torch.randn(1, conv_dim, L))[..., :L]
    # torch counts the padded output length (L + d_conv - 1); ours counts the L causal outputs
    assert fl.flops_per_sequence(m, 128, L)["mamba_conv"] == 2 * L * m.mamba.d_conv * conv_dim
    assert fc.get_total_flops() == 2 * (L + m.mamba.d_conv - 1) * m.mamba.d_conv * conv_dim


def test_attention_causal_convention():
    m = tiny("*")
    hd, nh = m.d_model // m.attn.n_heads, m.attn.n_heads
    full_mask = torch.ones(L, L).tril()
    assert fl.causal_pairs(L) == int(full_mask.sum()) == L * (L + 1) // 2
    assert fl.flops_per_sequence(m, 128, L)["attn_scores"] == 4 * hd * nh * L * (L + 1) // 2
    # attention computed as plain masked matmuls costs the full L x L: ours is the lower triangle
    q = torch.randn(1, nh, L, hd)
    with FlopCounterMode(display=False) as fc:
        s = (q @ q.transpose(-1, -2)).masked_fill(full_mask == 0, float("-inf"))
        F.softmax(s, dim=-1) @ q
    assert fc.get_total_flops() == 4 * hd * nh * L * L
    assert fl.flops_per_sequence(m, 128, L)["attn_scores"] * 2 * L == fc.get_total_flops() * (L + 1)

    # sliding window W: each query sees its W most recent keys (itself included), as the model's mask
    for W in (1, 7, L, 3 * L):
        mw = tiny("*", **{"model.attn.sliding_window": W})
        qi, kj = torch.arange(L)[:, None], torch.arange(L)[None, :]
        mask = (kj <= qi) & (qi - kj < W)
        assert fl.causal_pairs(L, W) == int(mask.sum())
        assert fl.flops_per_sequence(mw, 128, L)["attn_scores"] == 4 * hd * nh * int(mask.sum())


def reference_chunked_ssd_matmuls(x, B, C, Q):
    """The matmuls of a chunked SSD over full chunks, written out (decays omitted: elementwise).
    x [L, H, P], B/C [L, G, N]. Returns nothing; run under FlopCounterMode."""
    Lx, H, P = x.shape
    G = B.shape[1]
    rep = H // G
    for c0 in range(0, Lx, Q):
        xc, Bc, Cc = x[c0:c0 + Q], B[c0:c0 + Q], C[c0:c0 + Q]
        Bh = Bc.repeat_interleave(rep, dim=1)  # [q, H, N]
        Ch = Cc.repeat_interleave(rep, dim=1)
        torch.einsum("hpq,hqn->hpn", xc.permute(1, 2, 0), Bh.permute(1, 0, 2))  # chunk state, per head
        h = torch.zeros(H, P, Bc.shape[-1])
        torch.einsum("qhn,hpn->qhp", Ch, h)  # output from the incoming state


def test_ssd_terms():
    m = tiny("M")
    Q, N, G, P = m.mamba.chunk_size, m.mamba.d_state, m.mamba.ngroups, m.mamba.headdim
    H = 2 * m.d_model // P
    terms = fl.ssd_flops(L, Q, H, P, G, N)
    # intra-chunk pairs: the block-diagonal causal mask of chunk size Q (last chunk partial)
    idx = torch.arange(L)
    mask = (idx[None] <= idx[:, None]) & (idx[None] // Q == idx[:, None] // Q)
    pairs = int(mask.sum())
    assert terms["scores"] == 2 * N * G * pairs
    assert terms["intra"] == 2 * P * H * pairs
    assert terms["state_passing"] == 2 * P * N * H * 3  # ceil(40 / 16) chunks
    with FlopCounterMode(display=False) as fc:
        reference_chunked_ssd_matmuls(torch.randn(L, H, P), torch.randn(L, G, N), torch.randn(L, G, N), Q)
    assert fc.get_total_flops() == terms["chunk_state"] + terms["state_output"]
    assert fl.flops_per_sequence(m, 128, L)["mamba_ssd"] == sum(terms.values())
    # exact multiple of the chunk size
    t2 = fl.ssd_flops(64, 16, H, P, G, N)
    assert t2["scores"] == 2 * N * G * 4 * (16 * 17 // 2)


def test_totals_mfu_and_peaks(monkeypatch):
    m = tiny()
    out = fl.flops_per_sequence(m, 256, L)
    per_token = fl.train_flops_per_token(m, 256, L)
    assert per_token == 3 * out["total"] / L
    assert fl.params_flops_6nd(1_000_000) == 6e6
    assert fl.mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    assert fl.mfu(1000.0, 1e9, None) is None
    monkeypatch.delenv("MEGASSM_PEAK_FLOPS", raising=False)
    assert fl.peak_flops_for("cpu") is None and fl.peak_flops_for(torch.device("cpu")) is None
    assert fl.peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert fl.peak_flops_for_name("NVIDIA H200") == 989e12
    assert fl.peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert fl.peak_flops_for_name("NVIDIA H100 PCIe") == 756e12
    assert fl.peak_flops_for_name("NVIDIA RTX A4000") is None
    monkeypatch.setenv("MEGASSM_PEAK_FLOPS", "1e12")
    assert fl.peak_flops_for("cpu") == 1e12
    # pure Mamba: the counted projections are 2 x the non-embedding linear parameters
    pure = tiny("MM")
    o = fl.flops_per_sequence(pure, 128, L)
    assert o["attn_proj"] == o["attn_scores"] == o["mlp"] == 0
    with pytest.raises(ValueError, match="letter"):
        fl.flops_per_sequence(ModelConfig(pattern="MQ"), 128, L)
