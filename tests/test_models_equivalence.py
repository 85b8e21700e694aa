"""One semantics in every path: full forward, token-by-token decoding, windows with carried states, packed
documents vs documents alone; and the Mamba-2 mixer against a naive recurrence written here from the math."""
import pytest
import torch
import torch.nn.functional as F

from megassm.config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig
from megassm.models import build_model, reset_states
from megassm.models.attention import Attention

from compare import randomize_

V = 97


def tiny(pattern, window=0, rope=True, doc_mask=True, **mamba):
    mc = dict(d_state=8, headdim=8, chunk_size=4, ngroups=2)
    mc.update(mamba)
    return ModelConfig(
        pattern=pattern,
        d_model=32,
        mamba=MambaConfig(**mc),
        attn=AttentionConfig(n_heads=4, n_kv_heads=2, sliding_window=window, rope=rope, doc_mask=doc_mask),
        mlp=MLPConfig(ffn_hidden=48),
    )


def make(cfg, seed=0, dtype=torch.float32):
    m = build_model(cfg, vocab_size=V)
    m.init_weights(seed)
    return m.to(dtype).eval()


def assert_rel(a, b, tol=1e-5):
    a, b = a.detach().double(), b.detach().double()
    err = (a - b).abs().max().item()
    scale = b.abs().max().item()
    assert err <= tol * scale, f"max abs diff {err:.3g} vs scale {scale:.3g} (rel {err / scale:.3g})"


MODELS = {
    "mamba2": dict(pattern="MMM"),
    "hybrid": dict(pattern="M*M-"),
    "hybrid_window": dict(pattern="M*M-", window=3),
    "hybrid_nope": dict(pattern="*M-", rope=False),
}

# two rows, 14 tokens; row 0 switches document at t=6 and t=11, row 1 is one document
SEQ_IDX = torch.tensor([[0] * 6 + [1] * 5 + [2] * 3, [5] * 14], dtype=torch.int32)


def tokens_for(seed=0, shape=(2, 14)):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_step_matches_forward(name):
    model = make(tiny(**MODELS[name]))
    tok = tokens_for()
    with torch.no_grad():
        full = model(tok, seq_idx=SEQ_IDX).logits
    states = model.allocate_states(2)
    outs = []
    for t in range(tok.shape[1]):
        reset = (SEQ_IDX[:, t] != SEQ_IDX[:, t - 1]) if t > 0 else None
        logits, states = model.step(tok[:, t], states, reset=reset)
        outs.append(logits)
    assert_rel(torch.stack(outs, 1), full)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("split", [3, 6, 9])  # 6: the second window starts a new document in row 0
def test_windows_with_carried_states(name, split):
    model = make(tiny(**MODELS[name]))
    tok = tokens_for(1)
    with torch.no_grad():
        full = model(tok, seq_idx=SEQ_IDX).logits
        a = model(tok[:, :split], seq_idx=SEQ_IDX[:, :split], return_states=True)
        starts_new = SEQ_IDX[:, split] != SEQ_IDX[:, split - 1]
        states = reset_states(a.states, starts_new)
        b = model(tok[:, split:], seq_idx=SEQ_IDX[:, split:], states=states, return_states=True)
    assert_rel(torch.cat([a.logits, b.logits], 1), full)
    # and decoding continues from the forward's final states
    with torch.no_grad():
        nxt = tokens_for(2, (2,))
        step_logits, _ = model.step(nxt, b.states)
        ref = model(torch.cat([tok, nxt[:, None]], 1), seq_idx=torch.cat([SEQ_IDX, SEQ_IDX[:, -1:]], 1)).logits[:, -1]
    assert_rel(step_logits, ref)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_document_equals_document_alone(name):
    """A document's logits do not depend on what precedes it in the row (attention masks, RoPE positions,
    conv taps and SSM state all restart), and equal those of the document alone."""
    model = make(tiny(**MODELS[name]))
    tok = tokens_for(3)
    tok2 = tok.clone()
    tok2[0, :6] = tokens_for(4, (6,))  # change document 0 of row 0
    with torch.no_grad():
        a = model(tok, seq_idx=SEQ_IDX).logits
        b = model(tok2, seq_idx=SEQ_IDX).logits
        alone = model(tok[:1, 6:11]).logits
    assert not torch.allclose(a[0, :6], b[0, :6])
    assert torch.equal(a[0, 6:], b[0, 6:]) or (a[0, 6:] - b[0, 6:]).abs().max() < 1e-6
    assert_rel(a[0, 6:11], alone[0])


def test_attention_doc_mask_switch():
    """doc_mask=False: attention sees across documents (Mamba still resets), so the test above is meaningful."""
    model = make(tiny("*-", doc_mask=False))
    tok = tokens_for(3)
    tok2 = tok.clone()
    tok2[0, :6] = tokens_for(4, (6,))
    with torch.no_grad():
        a = model(tok, seq_idx=SEQ_IDX).logits
        b = model(tok2, seq_idx=SEQ_IDX).logits
    assert (a[0, 6:] - b[0, 6:]).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------
# capture-safe attention (LanguageModel.capture_safe, train.cuda_graph): single_doc=False builds the document
# mask on the device for every batch; it must give what the default path gives
# ----------------------------------------------------------------------------------------------------
def _attn_outputs_and_grads(attn, u, seq_idx, single_doc):
    u = u.detach().clone().requires_grad_(True)
    attn.zero_grad(set_to_none=True)
    out, _ = attn(u, seq_idx=seq_idx, single_doc=single_doc)
    # a fixed cotangent that weighs every position differently
    w = torch.linspace(-1.0, 1.0, out.numel(), dtype=torch.float32).reshape(out.shape).to(out.dtype)
    (out.float() * w.float()).sum().backward()
    return [out.detach(), u.grad] + [p.grad for p in attn.parameters()]


def _doc_ids(rows: int, seqlen: int, resets: bool) -> torch.Tensor:
    """Nondecreasing document ids [rows, seqlen]: with resets, each row switches document at a few
    row-dependent places (one row also starts a document at its last token); else one document a row."""
    sid = torch.zeros(rows, seqlen, dtype=torch.int32)
    if resets:
        for r in range(rows):
            for cut in {(r + 1) * seqlen // 4, seqlen // 2 + r, seqlen - 1 - r % 2}:
                if 0 < cut < seqlen:
                    sid[r, cut:] += 1
            sid[r] += 7 * r
    else:
        sid += torch.arange(rows, dtype=torch.int32)[:, None] * 3
    return sid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqlen", [13, 37])  # odd lengths, and one past 32
@pytest.mark.parametrize("n_kv_heads, window, rope", [(4, 0, True), (2, 0, True), (1, 0, False), (2, 5, True)])
@pytest.mark.parametrize("resets", [True, False])
def test_capture_safe_attention_equals_default_path(dtype, seqlen, n_kv_heads, window, rope, resets):
    """single_doc=False (no host read) against the default (single_doc=None: tested on the host), outputs and
    gradients of input and weights. With document resets both take the mask path: bit-identical. One document
    a row: the default takes the `is_causal` kernel (no window) and the capture-safe path the same causal mask
    explicitly: equal up to the kernels' rounding."""
    cfg = ModelConfig(pattern="*", d_model=32, attn=AttentionConfig(n_heads=4, n_kv_heads=n_kv_heads,
                                                                    sliding_window=window, rope=rope))
    torch.manual_seed(0)
    attn = Attention(cfg, 2).to(dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)  # logits well spread: masking differences would show
    u = torch.randn(3, seqlen, 32).to(dtype)
    sid = _doc_ids(3, seqlen, resets)
    default = _attn_outputs_and_grads(attn, u, sid, None)
    safe = _attn_outputs_and_grads(attn, u, sid, False)
    for i, (a, b) in enumerate(zip(safe, default)):
        if resets or window:
            assert torch.equal(a, b), f"tensor {i}: {(a.float() - b.float()).abs().max()}"
        else:
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(a, b, **tol, msg=f"tensor {i}")
    if resets:  # the documents are really separated (the comparison is not between two causal masks)
        plain, _ = attn(u, seq_idx=None)
        assert not torch.allclose(plain.float(), default[0].float(), atol=1e-3)


@pytest.mark.parametrize("name", ["hybrid", "hybrid_window", "hybrid_nope"])
@pytest.mark.parametrize("resets", [True, False])
def test_capture_safe_model_equals_default(name, resets):
    """The whole model with capture_safe set: the same loss and gradients as without it (the same mask with
    resets; the explicit causal mask instead of the causal kernel without)."""
    tok = tokens_for(7)
    sid = SEQ_IDX if resets else torch.tensor([[0] * 14, [4] * 14], dtype=torch.int32)
    runs = []
    for capture_safe in (False, True):
        model = make(tiny(**MODELS[name])).train()
        model.capture_safe = capture_safe
        out = model(tok, seq_idx=sid, labels=tok)
        out.loss.backward()
        runs.append([out.loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
        if resets:
            assert torch.equal(a, b)


def test_zero_states_equal_no_states():
    model = make(tiny("M*-", window=4))
    tok = tokens_for(5)
    with torch.no_grad():
        a = model(tok, seq_idx=SEQ_IDX).logits
        b = model(tok, seq_idx=SEQ_IDX, states=model.allocate_states(2)).logits
    assert_rel(b, a, 1e-6)


def test_states_format():
    cfg = tiny("M*-", window=4)
    model = make(cfg)
    with torch.no_grad():
        out = model(tokens_for(6), seq_idx=SEQ_IDX, return_states=True)
    m, kv, mlp = out.states
    conv_dim = 2 * 32 + 2 * 2 * 8
    assert m.conv.shape == (2, conv_dim, 3) and m.conv.dtype == torch.float32
    assert m.ssm.shape == (2, 8, 8, 8) and m.ssm.dtype == torch.float32
    assert kv.k.shape == (2, 2, 4, 8) and kv.valid.shape == (2, 4)  # sliding window keeps the last W
    assert kv.valid[0].tolist() == [False, True, True, True]  # row 0's last document has 3 tokens
    assert kv.pos.tolist() == [3, 14]
    assert mlp is None


# ----------------------------------------------------------------------------------------------------
# The mixer against a naive implementation of the Mamba-2 layer, written from the math
# ----------------------------------------------------------------------------------------------------


def naive_mamba2(mix, u, conv_state=None, ssm_state=None):
    """One row at a time, one token at a time, in fp64. u [B, L, d_model] (a single document per row)."""
    f64 = lambda t: t.detach().double()  # noqa: E731
    u = f64(u)
    bsz, L, _ = u.shape
    H, P, G, N, W = mix.nheads, mix.headdim, mix.ngroups, mix.d_state, mix.d_conv
    d_inner = H * P
    zxbcdt = u @ f64(mix.in_proj.weight).T
    if mix.in_proj.bias is not None:
        zxbcdt = zxbcdt + f64(mix.in_proj.bias)
    z = zxbcdt[..., :d_inner]
    xBC = zxbcdt[..., d_inner : 2 * d_inner + 2 * G * N]
    dt_raw = zxbcdt[..., 2 * d_inner + 2 * G * N :]
    w, bias = f64(mix.conv1d.weight), f64(mix.conv1d.bias)
    if conv_state is None:
        hist = torch.zeros(bsz, W - 1, xBC.shape[-1], dtype=torch.float64)
    else:
        hist = f64(conv_state).transpose(1, 2)
    seq = torch.cat([hist, xBC], 1)
    conv = torch.stack([bias + sum(w[:, k] * seq[:, t + k] for k in range(W)) for t in range(L)], 1)
    xBC = F.silu(conv)
    x = xBC[..., :d_inner].reshape(bsz, L, H, P)
    Bm = xBC[..., d_inner : d_inner + G * N].reshape(bsz, L, G, N)
    Cm = xBC[..., d_inner + G * N :].reshape(bsz, L, G, N)
    dt = F.softplus(dt_raw + f64(mix.dt_bias))
    if mix.dt_limit is not None:
        dt = dt.clamp(*mix.dt_limit)
    A = -torch.exp(f64(mix.A_log))
    D = f64(mix.D)
    h = torch.zeros(bsz, H, P, N, dtype=torch.float64) if ssm_state is None else f64(ssm_state).clone()
    ys = torch.zeros(bsz, L, H, P, dtype=torch.float64)
    for b in range(bsz):
        for t in range(L):
            for hd in range(H):
                g = hd // (H // G)
                inp = dt[b, t, hd] * torch.outer(x[b, t, hd], Bm[b, t, g])
                h[b, hd] = torch.exp(dt[b, t, hd] * A[hd]) * h[b, hd] + inp
                skip = D[hd] * x[b, t, hd]
                ys[b, t, hd] = h[b, hd] @ Cm[b, t, g] + skip
    y = ys.reshape(bsz, L, d_inner)
    gate = F.silu(z)
    if not mix.norm.norm_before_gate:
        y = y * gate
    yg = y.reshape(bsz, L, G, d_inner // G)
    yg = yg / torch.sqrt(yg.pow(2).mean(-1, keepdim=True) + mix.norm.eps)
    y = yg.reshape(bsz, L, d_inner) * f64(mix.norm.weight)
    if mix.norm.norm_before_gate:
        y = y * gate
    out = y @ f64(mix.out_proj.weight).T
    if mix.out_proj.bias is not None:
        out = out + f64(mix.out_proj.bias)
    return out, seq[:, -(W - 1) :].transpose(1, 2), h


MIXER_VARIANTS = {
    "default": dict(),
    "groups1_hdimD_normfirst": dict(ngroups=1, D_has_hdim=True, norm_before_gate=True),
    "dt_limit_bias_conv3": dict(dt_limit=[0.01, 0.05], proj_bias=True, d_conv=3),
}


@pytest.mark.parametrize("variant", sorted(MIXER_VARIANTS))
def test_mixer_vs_naive(variant):
    model = make(tiny("M", **MIXER_VARIANTS[variant]), seed=7)
    mix = model.layers[0].mixer
    want_bias = MIXER_VARIANTS[variant].get("proj_bias", False)  # the naive follows the module's biases
    assert (mix.in_proj.bias is not None) == want_bias and (mix.out_proj.bias is not None) == want_bias
    randomize_(mix.named_parameters(), seed=1, scale=0.3)  # every parameter matters: biases, D, norm weight
    assert all(p.abs().max() > 0 for p in mix.parameters())
    g = torch.Generator().manual_seed(1)
    u = torch.randn(2, 11, 32, generator=g)
    ref, ref_conv, ref_ssm = naive_mamba2(mix, u)
    with torch.no_grad():
        out, st = mix(u, return_state=True)
    assert_rel(out, ref, 1e-5)
    assert_rel(st.conv, ref_conv, 1e-5)
    assert_rel(st.ssm, ref_ssm, 1e-5)
    # fp64 end to end: the reference ops are exact up to rounding
    mix64 = model.double().layers[0].mixer
    with torch.no_grad():
        out64, _ = mix64(u.double(), return_state=True)
    assert_rel(out64, ref, 1e-10)
    # with an initial state, and documents: each document behaves as if it were alone
    cs = torch.randn(2, mix.conv_dim, mix.d_conv - 1, generator=g, dtype=torch.float64)
    ss = torch.randn(2, mix.nheads, mix.headdim, mix.d_state, generator=g, dtype=torch.float64)
    seq_idx = torch.tensor([[0] * 5 + [1] * 6, [3] * 11], dtype=torch.int32)
    from megassm.models import MambaState

    with torch.no_grad():
        out, st = mix64(u.double(), seq_idx=seq_idx, state=MambaState(conv=cs, ssm=ss), return_state=True)
    r0a, _, _ = naive_mamba2(mix64, u[:1, :5], cs[:1], ss[:1])
    r0b, c0b, s0b = naive_mamba2(mix64, u[:1, 5:])
    r1, c1, s1 = naive_mamba2(mix64, u[1:], cs[1:], ss[1:])
    assert_rel(out[0, :5], r0a[0], 1e-10)
    assert_rel(out[0, 5:], r0b[0], 1e-10)
    assert_rel(out[1], r1[0], 1e-10)
    assert_rel(st.conv, torch.cat([c0b, c1]), 1e-10)
    assert_rel(st.ssm, torch.cat([s0b, s1]), 1e-10)
