"""Pure-PyTorch reference ops (each op folder's reference.py) against literal oracles.

The chunked SSD, the reference's own token loop (ssd_sequential, the Triton tests' oracle) and the decode
step are checked against ssd_oracle, the recurrence written here from its definition without any of the
reference's helpers (outputs, final states and the gradient of every input), across padding, groups,
document resets, chunk sizes and sequence splits. Conv and norms are
checked against naive loops and with gradcheck. Everything is CPU and small.
"""
import inspect
import logging

import pytest
import torch
import torch.nn.functional as F

import megassm.kernels as K
from megassm.kernels.conv1d.reference import causal_conv1d, causal_conv1d_step
from megassm.kernels.norm.reference import add_rmsnorm, gated_rmsnorm, rmsnorm
from megassm.kernels.mamba2_ssd.reference import segsum, ssd, ssd_sequential, ssd_step

F64 = torch.float64


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------------------------------------
# SSD helpers


def ssd_oracle(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=None,
               initial_states=None, seq_idx=None, return_final_states=False):
    """The SSD from its definition, in fp64, one token at a time:
        dt_t = clamp(softplus(dt_t + dt_bias), dt_limit)
        h_t  = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        (h = 0 at a document start, initial state before)
        y_t  = (h_t C_t + D x_t) * silu(z_t)
    Head h reads group h // (H / G) of B and C."""
    f = lambda t: t.to(F64)  # noqa: E731
    bsz, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    group = torch.arange(H) // (H // G)
    d = f(dt) + (f(dt_bias) if dt_bias is not None else 0.0)
    if dt_softplus:
        d = torch.log1p(torch.exp(d))
    if dt_limit is not None:
        d = d.clamp(dt_limit[0], dt_limit[1])
    h = f(initial_states) if initial_states is not None else torch.zeros(bsz, H, P, N, dtype=F64)
    ys = []
    for t in range(L):
        if seq_idx is not None and t > 0:
            same = (seq_idx[:, t] == seq_idx[:, t - 1]).to(F64)
            h = h * same[:, None, None, None]
        Bt, Ct = f(B[:, t])[:, group], f(C[:, t])[:, group]  # [b, H, N]
        xt = f(x[:, t])  # [b, H, P]
        h = torch.exp(d[:, t] * f(A))[:, :, None, None] * h + (d[:, t, :, None] * xt)[..., None] * Bt[:, :, None, :]
        y = (h * Ct[:, :, None, :]).sum(-1)
        if D is not None:
            Dd = f(D)
            y = y + (Dd[:, None] if Dd.dim() == 1 else Dd) * xt
        if z is not None:
            zt = f(z[:, t])
            y = y * zt * torch.sigmoid(zt)
        ys.append(y)
    y = torch.stack(ys, 1) if ys else torch.zeros(x.shape, dtype=F64)
    return (y, h) if return_final_states else y

# Document starts per batch row (chunk 16 in the tests): length-1 documents, resets exactly on a chunk edge
# (16, 32, 48), a reset on the last token, and rows with different layouts.
DOC_STARTS = {
    1: ([0], [0]),
    7: ([0, 3, 4], [0, 6]),
    37: ([0, 5, 6, 16, 31], [0, 15, 16, 32]),
    64: ([0, 16, 17, 48], [0, 1, 33, 63]),
}


def make_seq_idx(starts_per_row, seqlen, offset=0):
    rows = []
    for r, starts in enumerate(starts_per_row):
        row = torch.zeros(seqlen, dtype=torch.int32)
        for s in starts:
            if 0 < s < seqlen:
                row[s:] += 1
        rows.append(row + offset + 3 * r)  # ids need not start at 0, nor match across rows
    return torch.stack(rows)


def make_ssd_inputs(bsz=2, seqlen=37, nheads=4, hdim=3, ngroups=2, dstate=5, dtype=F64, d_mode="head",
                    gate=True, bias=True, init=False, seed=0, dt_positive=False):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype)

    inp = dict(
        x=rnd(bsz, seqlen, nheads, hdim),
        dt=(torch.rand(bsz, seqlen, nheads, generator=g, dtype=F64) * 0.5 + 0.01).to(dtype)
        if dt_positive else rnd(bsz, seqlen, nheads),
        A=-(torch.rand(nheads, generator=g, dtype=F64) * 2 + 0.1).to(dtype),
        B=rnd(bsz, seqlen, ngroups, dstate),
        C=rnd(bsz, seqlen, ngroups, dstate),
    )
    if d_mode == "head":
        inp["D"] = rnd(nheads)
    elif d_mode == "chan":
        inp["D"] = rnd(nheads, hdim)
    if gate:
        inp["z"] = rnd(bsz, seqlen, nheads, hdim)
    if bias:
        inp["dt_bias"] = rnd(nheads, scale=0.5)
    if init:
        inp["initial_states"] = rnd(bsz, nheads, hdim, dstate)
    return inp


def leaf(inp, dtype=None):
    return {k: v.detach().to(dtype or v.dtype).requires_grad_(True) for k, v in inp.items()}


def run_with_grads(fn, inp, seed=1, **kw):
    """Forward + backward of sum(y*gy) + sum(final*gf): returns y, final, {name: grad}."""
    y, final = fn(**inp, return_final_states=True, **kw)
    g = torch.Generator().manual_seed(seed)
    gy = torch.randn(y.shape, generator=g, dtype=F64).to(y.dtype)
    gf = torch.randn(final.shape, generator=g, dtype=F64).to(final.dtype)
    loss = (y.to(F64) * gy).sum() + (final.to(F64) * gf).sum()
    names = list(inp)
    grads = torch.autograd.grad(loss, [inp[k] for k in names])
    return y.detach(), final.detach(), dict(zip(names, grads))


SSD_VARIANTS = {
    "bare": dict(make=dict(d_mode=None, gate=False, bias=False), kw={}),
    "Dhead_init": dict(make=dict(d_mode="head", init=True), kw={}),
    "Dchan_seq": dict(make=dict(d_mode="chan"), kw=dict(seq=True)),
    "all_dtlimit": dict(make=dict(d_mode="chan", init=True), kw=dict(seq=True, dt_limit=(0.05, 1.0))),
    "no_softplus": dict(make=dict(d_mode="head", init=True, bias=False, dt_positive=True),
                        kw=dict(seq=True, dt_softplus=False)),
}


def variant_call(name, seqlen, ngroups, dtype=F64, seed=0):
    v = SSD_VARIANTS[name]
    inp = make_ssd_inputs(seqlen=seqlen, ngroups=ngroups, dtype=dtype, seed=seed, **v["make"])
    kw = dict(v["kw"])
    if kw.pop("seq", False):
        kw["seq_idx"] = make_seq_idx(DOC_STARTS[seqlen], seqlen)
    return inp, kw


# --------------------------------------------------------------------------------------------------------
# SSD: chunked, sequential and step vs the oracle


@pytest.mark.parametrize("variant", list(SSD_VARIANTS))
@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize("seqlen", [1, 7, 37, 64])
def test_ssd_matches_oracle_fp64(seqlen, ngroups, variant):
    inp, kw = variant_call(variant, seqlen, ngroups)
    y, f, g = run_with_grads(ssd, leaf(inp), chunk_size=16, **kw)
    y_ref, f_ref, g_ref = run_with_grads(ssd_oracle, leaf(inp), **kw)
    assert y.dtype == F64 and f.shape == (2, 4, 3, 5)
    assert rel_err(y, y_ref) < 1e-12
    assert rel_err(f, f_ref) < 1e-12
    for k in inp:
        assert g[k].shape == inp[k].shape
        assert rel_err(g[k], g_ref[k]) < 1e-10, k


@pytest.mark.parametrize("variant", list(SSD_VARIANTS))
@pytest.mark.parametrize("seqlen", [7, 37])
def test_ssd_sequential_matches_oracle(seqlen, variant):
    """The reference's token loop, which the Triton tests use as their oracle, against the definition."""
    inp, kw = variant_call(variant, seqlen, ngroups=2)
    y, f, g = run_with_grads(ssd_sequential, leaf(inp), **kw)
    y_ref, f_ref, g_ref = run_with_grads(ssd_oracle, leaf(inp), **kw)
    assert rel_err(y, y_ref) < 1e-12 and rel_err(f, f_ref) < 1e-12
    for k in inp:
        assert rel_err(g[k], g_ref[k]) < 1e-10, k


@pytest.mark.parametrize("variant", ["Dhead_init", "all_dtlimit"])
@pytest.mark.parametrize("seqlen", [37, 64])
def test_ssd_fp32_against_fp64_oracle(seqlen, variant):
    inp, kw = variant_call(variant, seqlen, ngroups=2, dtype=torch.float32)
    y, f, g = run_with_grads(ssd, leaf(inp), chunk_size=16, **kw)
    y_ref, f_ref, g_ref = run_with_grads(ssd_oracle, leaf(inp, F64), **kw)
    assert y.dtype == torch.float32 and f.dtype == torch.float32
    assert rel_err(y, y_ref) < 1e-5
    assert rel_err(f, f_ref) < 1e-5
    for k in inp:
        assert g[k].dtype == torch.float32
        assert rel_err(g[k], g_ref[k]) < 1e-5, k


def test_ssd_bf16_inputs():
    """Activations in bf16, parameters and states in fp32 (the training setup under autocast)."""
    inp, kw = variant_call("all_dtlimit", 64, ngroups=2, dtype=torch.float32)
    for k in ("x", "dt", "B", "C", "z"):
        inp[k] = inp[k].to(torch.bfloat16)
    y, f, g = run_with_grads(ssd, leaf(inp), chunk_size=16, **kw)
    y_ref, f_ref, g_ref = run_with_grads(ssd_oracle, leaf(inp, F64), **kw)  # same rounded inputs
    assert y.dtype == torch.bfloat16 and f.dtype == torch.float32
    assert rel_err(y, y_ref) < 1e-2  # bf16 rounding of y only: ~2^-9
    assert rel_err(f, f_ref) < 1e-5  # the state never leaves fp32
    for k in inp:
        assert g[k].dtype == inp[k].dtype
        assert rel_err(g[k], g_ref[k]) < 2e-2, k


def test_ssd_chunk_size_invariance():
    inp, kw = variant_call("all_dtlimit", 64, ngroups=2)
    ref = run_with_grads(ssd, leaf(inp), chunk_size=64, **kw)
    for chunk in (1, 8, 16, 24, 256):
        out = run_with_grads(ssd, leaf(inp), chunk_size=chunk, **kw)
        assert rel_err(out[0], ref[0]) < 1e-12 and rel_err(out[1], ref[1]) < 1e-12
        for k in inp:
            assert rel_err(out[2][k], ref[2][k]) < 1e-11, (chunk, k)


def test_ssd_defaults_and_plain_return():
    inp = make_ssd_inputs(seqlen=7, d_mode=None, gate=False, bias=False)
    y = ssd(**inp)  # default chunk 256 > L, no final state requested
    assert isinstance(y, torch.Tensor) and y.shape == inp["x"].shape
    torch.testing.assert_close(y, ssd_oracle(**inp), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("splits", [[23], [30], [16], [5, 17, 31, 32]])
def test_ssd_split_with_state_passing(splits):
    """Running [0, s) then [s, L) with final -> initial state equals one run: values and gradients.

    A reset that falls exactly on a split is the caller's to apply (zero the carried state), exactly as in
    BPTT where the data loader flags rows whose window starts a new document.
    """
    seqlen = 40
    inp = make_ssd_inputs(seqlen=seqlen, d_mode="chan", init=True, seed=3)
    seq_idx = make_seq_idx(([0, 10, 30], [0, 16, 17, 39]), seqlen)
    full = leaf(inp)
    y_full, f_full, g_full = run_with_grads(ssd, full, chunk_size=8, seq_idx=seq_idx)

    parts = leaf(inp)
    bounds = [0] + splits + [seqlen]
    state, ys = parts["initial_states"], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if lo > 0:  # caller-side reset at the boundary
            starts_doc = (seq_idx[:, lo] != seq_idx[:, lo - 1]).view(-1, 1, 1, 1)
            state = torch.where(starts_doc, torch.zeros_like(state), state)
        piece = {k: v[:, lo:hi] for k, v in parts.items() if k in ("x", "dt", "B", "C", "z")}
        y, state = ssd(**piece, A=parts["A"], D=parts["D"], dt_bias=parts["dt_bias"], initial_states=state,
                       seq_idx=seq_idx[:, lo:hi], chunk_size=8, return_final_states=True)
        ys.append(y)
    y_split = torch.cat(ys, dim=1)
    g = torch.Generator().manual_seed(1)  # same cotangents as run_with_grads
    gy = torch.randn(y_split.shape, generator=g, dtype=F64)
    gf = torch.randn(state.shape, generator=g, dtype=F64)
    grads = torch.autograd.grad((y_split * gy).sum() + (state * gf).sum(), list(parts.values()))

    assert rel_err(y_split, y_full) < 1e-12
    assert rel_err(state, f_full) < 1e-12
    for k, gk in zip(parts, grads):
        assert rel_err(gk, g_full[k]) < 1e-11, k


def test_ssd_first_document_only_gets_initial_state():
    inp = make_ssd_inputs(seqlen=12, init=True, d_mode=None, gate=False)
    seq_idx = make_seq_idx(([0, 4], [0, 4]), 12)
    y_with = ssd(**inp, seq_idx=seq_idx, chunk_size=4)
    y_without = ssd(**{k: v for k, v in inp.items() if k != "initial_states"}, seq_idx=seq_idx, chunk_size=4)
    assert (y_with[:, :4] - y_without[:, :4]).abs().max() > 1e-3
    torch.testing.assert_close(y_with[:, 4:], y_without[:, 4:], rtol=0, atol=1e-13)


def test_ssd_extreme_decay_is_finite_and_accurate():
    """dt up to 10 and A down to -100 over L=2048: log-decays per step down to -1000."""
    seqlen, nheads = 2048, 4
    g = torch.Generator().manual_seed(0)
    inp = dict(
        x=torch.randn(1, seqlen, nheads, 4, generator=g),
        dt=torch.rand(1, seqlen, nheads, generator=g) * 15 - 5,  # softplus -> (0.007, 10)
        A=-torch.tensor([0.01, 1.0, 30.0, 100.0]),
        B=torch.randn(1, seqlen, 1, 4, generator=g),
        C=torch.randn(1, seqlen, 1, 4, generator=g),
        D=torch.ones(nheads),
        initial_states=torch.randn(1, nheads, 4, 4, generator=g) * 100,
    )
    seq_idx = make_seq_idx(([0, 700, 1500],), seqlen)
    params = leaf(inp)
    y, f = ssd(**params, seq_idx=seq_idx, return_final_states=True)  # default chunk 256
    (y.square().mean() + f.square().mean()).backward()
    assert torch.isfinite(y).all() and torch.isfinite(f).all()
    for k, v in params.items():
        assert torch.isfinite(v.grad).all(), k
    with torch.no_grad():
        y_ref, f_ref = ssd_oracle(**leaf(inp, F64), seq_idx=seq_idx, return_final_states=True)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(f, f_ref) < 1e-5


def test_ssd_decay_after_large_accumulated_decay_is_exact():
    """Strong decay early in a chunk, weak decay after: the decay between two late positions must not be
    computed as exp(prefix_i - prefix_j) with |prefix| ~ 1e4 (fp32 would lose ~1e-3 relative there)."""
    seqlen, chunk = 64, 64
    g = torch.Generator().manual_seed(0)
    dt = torch.full((1, seqlen, 2), 1e-3)
    dt[:, :12] = 10.0
    inp = dict(x=torch.randn(1, seqlen, 2, 3, generator=g), dt=dt, A=-torch.tensor([100.0, 90.0]),
               B=torch.randn(1, seqlen, 1, 2, generator=g), C=torch.randn(1, seqlen, 1, 2, generator=g))
    y, f = ssd(**inp, dt_softplus=False, chunk_size=chunk, return_final_states=True)
    y_ref, f_ref = ssd_oracle(**leaf(inp, F64), dt_softplus=False, return_final_states=True)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(f, f_ref) < 1e-5


def test_segsum():
    a = torch.randn(3, 6, dtype=F64)
    s = segsum(a)
    for i in range(6):
        for j in range(6):
            if j > i:
                assert s[:, i, j].eq(float("-inf")).all()
            else:
                torch.testing.assert_close(s[:, i, j], a[:, j + 1 : i + 1].sum(-1))


def test_ssd_gradcheck_tiny():
    inp = make_ssd_inputs(bsz=1, seqlen=5, nheads=2, hdim=2, ngroups=1, dstate=2, d_mode="chan", init=True)
    seq_idx = make_seq_idx(([0, 3],), 5)
    names = list(inp)

    def fn(*tensors):
        y, f = ssd(**dict(zip(names, tensors)), seq_idx=seq_idx, chunk_size=2, return_final_states=True)
        return y, f

    assert torch.autograd.gradcheck(fn, tuple(leaf(inp).values()))


def test_ssd_step_matches_ssd():
    seqlen = 37
    inp = make_ssd_inputs(seqlen=seqlen, d_mode="chan", init=True, seed=5)
    seq_idx = make_seq_idx(DOC_STARTS[seqlen], seqlen)
    y_ref, f_ref = ssd_oracle(**inp, seq_idx=seq_idx, dt_limit=(0.0, 2.0), return_final_states=True)
    state, ys = inp["initial_states"], []
    for t in range(seqlen):
        if t > 0:
            reset = (seq_idx[:, t] != seq_idx[:, t - 1]).view(-1, 1, 1, 1)
            state = torch.where(reset, torch.zeros_like(state), state)
        y, state = ssd_step(state, inp["x"][:, t], inp["dt"][:, t], inp["A"], inp["B"][:, t], inp["C"][:, t],
                            D=inp["D"], z=inp["z"][:, t], dt_bias=inp["dt_bias"], dt_limit=(0.0, 2.0))
        ys.append(y)
    torch.testing.assert_close(torch.stack(ys, 1), y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, f_ref, rtol=1e-12, atol=1e-12)


def test_ssd_step_dtypes():
    state = torch.randn(2, 4, 3, 5)
    x = torch.randn(2, 4, 3, dtype=torch.bfloat16)
    y, new = ssd_step(state, x, torch.randn(2, 4, dtype=torch.bfloat16), -torch.rand(4),
                      torch.randn(2, 2, 5, dtype=torch.bfloat16), torch.randn(2, 2, 5, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 4, 3)
    assert new.dtype == torch.float32 and new.shape == state.shape


def test_ssd_rejects_bad_groups():
    inp = make_ssd_inputs(nheads=4, ngroups=3, d_mode=None, gate=False, bias=False)
    with pytest.raises(ValueError):
        ssd(**inp)


# --------------------------------------------------------------------------------------------------------
# causal conv1d


def conv_naive(x, weight, bias, init, seq_idx, activation):
    """Literal definition: y_t = act(bias + sum_k w[:, k] * in_{t-(W-1)+k}), taps within the document."""
    bsz, seqlen, _ = x.shape
    width = weight.shape[1]
    y = torch.zeros_like(x)
    final = torch.zeros(bsz, x.shape[2], width - 1, dtype=x.dtype)

    def value(b, s, doc_of):  # input at position s (< 0: carried state) as seen by a token of doc `doc_of`
        if seq_idx is not None:
            doc_s = seq_idx[b, max(s, 0)]
            if doc_s != doc_of:
                return torch.zeros_like(x[b, 0])
        if s >= 0:
            return x[b, s]
        return init[b, :, width - 1 + s] if init is not None else torch.zeros_like(x[b, 0])

    for b in range(bsz):
        for t in range(seqlen):
            doc = seq_idx[b, t] if seq_idx is not None else None
            acc = bias.clone() if bias is not None else torch.zeros_like(x[b, 0])
            for k in range(width):
                acc = acc + weight[:, k] * value(b, t - (width - 1) + k, doc)
            y[b, t] = F.silu(acc) if activation == "silu" else acc
        doc = seq_idx[b, -1] if seq_idx is not None else None
        for j in range(width - 1):
            final[b, :, j] = value(b, seqlen - (width - 1) + j, doc)
    return y, final


def make_conv_inputs(bsz=2, seqlen=9, channels=3, width=4, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(bsz, seqlen, channels, generator=g, dtype=dtype),
            torch.randn(channels, width, generator=g, dtype=dtype),
            torch.randn(channels, generator=g, dtype=dtype),
            torch.randn(bsz, channels, width - 1, generator=g, dtype=dtype))


@pytest.mark.parametrize("seqlen", [1, 2, 9])
@pytest.mark.parametrize("use_seq", [False, True])
@pytest.mark.parametrize("use_init", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_causal_conv1d_matches_naive(width, activation, use_init, use_seq, seqlen):
    x, w, b, init = make_conv_inputs(seqlen=seqlen, width=width)
    init = init if use_init else None
    starts = {1: ([0], [0]), 2: ([0, 1], [0]), 9: ([0, 1, 5], [0, 3, 8])}[seqlen]
    seq_idx = make_seq_idx(starts, seqlen) if use_seq else None
    y, final = causal_conv1d(x, w, b, initial_state=init, seq_idx=seq_idx, activation=activation,
                             return_final_state=True)
    y_ref, final_ref = conv_naive(x, w, b, init, seq_idx, activation)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final_ref, rtol=1e-12, atol=1e-12)
    y_only = causal_conv1d(x, w, b, initial_state=init, seq_idx=seq_idx, activation=activation)
    torch.testing.assert_close(y_only, y)


@pytest.mark.parametrize("width", [2, 4])
def test_causal_conv1d_step_matches_full(width):
    seqlen = 11
    x, w, b, init = make_conv_inputs(seqlen=seqlen, width=width, seed=2)
    seq_idx = make_seq_idx(([0, 4, 5], [0, 10]), seqlen)
    y_ref, final_ref = causal_conv1d(x, w, b, initial_state=init, seq_idx=seq_idx, return_final_state=True)
    state, ys = init, []
    for t in range(seqlen):
        if t > 0:
            reset = (seq_idx[:, t] != seq_idx[:, t - 1]).view(-1, 1, 1)
            state = torch.where(reset, torch.zeros_like(state), state)
        y, state = causal_conv1d_step(state, x[:, t], w, b)
        ys.append(y)
    torch.testing.assert_close(torch.stack(ys, 1), y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, final_ref, rtol=1e-12, atol=1e-12)


def test_causal_conv1d_split_with_state_passing():
    x, w, b, init = make_conv_inputs(seqlen=10, width=4, seed=4)
    seq_idx = make_seq_idx(([0, 6], [0, 1]), 10)
    y_full, f_full = causal_conv1d(x, w, b, init, seq_idx, return_final_state=True)
    y1, s = causal_conv1d(x[:, :2], w, b, init, seq_idx[:, :2], return_final_state=True)  # L < W-1
    y2, s = causal_conv1d(x[:, 2:], w, b, s, seq_idx[:, 2:], return_final_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, f_full, rtol=1e-12, atol=1e-12)


def test_causal_conv1d_gradcheck():
    x, w, b, init = make_conv_inputs(bsz=2, seqlen=6, channels=3, width=4)
    seq_idx = make_seq_idx(([0, 2], [0, 5]), 6)

    def fn(x, w, b, init):
        return causal_conv1d(x, w, b, init, seq_idx, return_final_state=True)

    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (x, w, b, init)))
    state = init[:, :, :].detach().clone().requires_grad_()
    xt = x[:, 0].detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda s, xx, ww, bb: causal_conv1d_step(s, xx, ww, bb),
                                    (state, xt, w, b))


def test_causal_conv1d_dtypes():
    x, w, b, init = make_conv_inputs(dtype=torch.float32)
    y, final = causal_conv1d(x.bfloat16(), w, b, init, return_final_state=True)
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32
    y32 = causal_conv1d(x.bfloat16().float(), w, b, init)
    assert rel_err(y, y32) < 1e-2
    ys, s = causal_conv1d_step(init, x[:, 0].bfloat16(), w, b)
    assert ys.dtype == torch.bfloat16 and s.dtype == torch.float32
    with pytest.raises(ValueError):
        causal_conv1d(x, w, activation="gelu")


# --------------------------------------------------------------------------------------------------------
# norms


def rms_naive(x, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def test_rmsnorm():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g, dtype=F64)
    w = torch.randn(8, generator=g, dtype=F64)
    torch.testing.assert_close(rmsnorm(x, w, eps=1e-5), rms_naive(x, 1e-5) * w)
    out = rmsnorm(x.bfloat16(), w.float())
    assert out.dtype == torch.bfloat16
    assert rel_err(out, rms_naive(x.bfloat16().double(), 1e-5) * w) < 1e-2
    assert torch.autograd.gradcheck(lambda a, b: rmsnorm(a, b), (x.requires_grad_(), w.requires_grad_()))


def gated_naive(x, z, w, ngroups, eps, norm_before_gate):
    size = x.shape[-1] // ngroups
    src = x if norm_before_gate else x * F.silu(z)
    parts = [rms_naive(src[..., i * size : (i + 1) * size], eps) for i in range(ngroups)]
    out = torch.cat(parts, -1) * w
    return out * F.silu(z) if norm_before_gate else out


@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("ngroups", [1, 4])
def test_gated_rmsnorm(ngroups, norm_before_gate):
    g = torch.Generator().manual_seed(ngroups)
    x, z = torch.randn(2, 3, 16, generator=g, dtype=F64), torch.randn(2, 3, 16, generator=g, dtype=F64)
    w = torch.randn(16, generator=g, dtype=F64)
    out = gated_rmsnorm(x, z, w, ngroups=ngroups, eps=1e-5, norm_before_gate=norm_before_gate)
    torch.testing.assert_close(out, gated_naive(x, z, w, ngroups, 1e-5, norm_before_gate))
    assert torch.autograd.gradcheck(
        lambda a, b, c: gated_rmsnorm(a, b, c, ngroups=ngroups, norm_before_gate=norm_before_gate),
        (x[..., :8].clone().requires_grad_(), z[..., :8].clone().requires_grad_(), w[:8].clone().requires_grad_()))
    out16 = gated_rmsnorm(x.bfloat16(), z.bfloat16(), w.float(), ngroups=ngroups, norm_before_gate=norm_before_gate)
    assert out16.dtype == torch.bfloat16
    ref16 = gated_naive(x.bfloat16().double(), z.bfloat16().double(), w, ngroups, 1e-5, norm_before_gate)
    assert rel_err(out16, ref16) < 1e-2


def test_gated_rmsnorm_without_gate_and_bad_groups():
    x, w = torch.randn(4, 12, dtype=F64), torch.randn(12, dtype=F64)
    torch.testing.assert_close(gated_rmsnorm(x, None, w, ngroups=3),
                               torch.cat([rms_naive(p, 1e-5) for p in x.split(4, -1)], -1) * w)
    with pytest.raises(ValueError):
        gated_rmsnorm(x, None, w, ngroups=5)


def test_add_rmsnorm():
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(2, 3, 8, generator=g, dtype=F64), torch.randn(2, 3, 8, generator=g, dtype=F64)
    w = torch.randn(8, generator=g, dtype=F64)
    out, new_res = add_rmsnorm(x, res, w)
    torch.testing.assert_close(new_res, res + x)
    torch.testing.assert_close(out, rms_naive(res + x, 1e-5) * w)
    out0, res0 = add_rmsnorm(x, None, w)  # first block: no residual yet
    torch.testing.assert_close(res0, x)
    torch.testing.assert_close(out0, rms_naive(x, 1e-5) * w)
    # bf16 activations: the residual stream is fp32, the normed output bf16
    out16, res16 = add_rmsnorm(x.bfloat16(), res.float(), w.float())
    assert out16.dtype == torch.bfloat16 and res16.dtype == torch.float32
    torch.testing.assert_close(res16, res.float() + x.bfloat16().float())
    _, res16b = add_rmsnorm(x.bfloat16(), None, w.float())
    assert res16b.dtype == torch.float32
    assert torch.autograd.gradcheck(lambda a, r, ww: add_rmsnorm(a, r, ww),
                                    (x.requires_grad_(), res.requires_grad_(), w.requires_grad_()))


# --------------------------------------------------------------------------------------------------------
# public API


def test_public_api_and_backend_log(caplog, monkeypatch):
    for name in ("ssd", "ssd_sequential", "ssd_step", "causal_conv1d", "causal_conv1d_step", "rmsnorm",
                 "gated_rmsnorm", "add_rmsnorm", "backend"):
        assert callable(getattr(K, name)), name
    assert K.backend() in ("reference", "triton")  # triton on a machine with CUDA + triton
    params = list(inspect.signature(K.ssd).parameters)
    assert params == ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus", "dt_limit", "initial_states",
                      "seq_idx", "chunk_size", "return_final_states"]
    assert list(inspect.signature(K.causal_conv1d).parameters) == [
        "x", "weight", "bias", "initial_state", "seq_idx", "activation", "return_final_state"]

    monkeypatch.setattr(K, "_announced", False)
    with caplog.at_level(logging.INFO, logger="megassm.kernels"):
        x = torch.randn(2, 4)
        K.rmsnorm(x, None)
        K.rmsnorm(x, None)
        inp = make_ssd_inputs(seqlen=5, dtype=torch.float32)
        torch.testing.assert_close(K.ssd(**inp, chunk_size=2), ssd(**inp, chunk_size=2))
    msgs = [r.getMessage() for r in caplog.records if r.name == "megassm.kernels"]
    assert len(msgs) == 1 and "PyTorch reference ops" in msgs[0]
