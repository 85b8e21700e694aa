"""The custom-op plumbing of megassm.kernels (torch path, fake tensors, env switch, logging, compile) and the
Triton conv, norm and decode-step kernels against the PyTorch references (outputs and every gradient), plus a
tiny model on the Triton kernels. The SSD kernels have their own file, test_kernels_ssd.py; the shared setup
and criteria are in kernel_cases.py.

Default run (CI, CPU): the plumbing, then the Triton kernels in Triton's CPU interpreter at tiny shapes;
skipped with the reason when triton cannot be imported. On a machine with CUDA the same tiny tests run on the
GPU; `pytest -m gpu tests/test_kernels_triton.py` adds the conv and norms at real shapes.
"""
import logging

import pytest
import torch

# kernel_cases sets TRITON_INTERPRET before kernels/triton is first imported
from kernel_cases import (
    DEV, F64, HAS_TRITON, INTERP, K, R, TRITON_WARNINGS, cast_inputs, gpu, needs_cuda, needs_triton, op_ssd, ops, rel,
    reset_starts, run_ssd, seq_from_starts, ssd_inputs,
)
from kernel_cases import triton_mode, torch_mode  # noqa: F401  (fixtures)

pytestmark = TRITON_WARNINGS


# --------------------------------------------------------------------------------------------------------
# custom-op plumbing (no triton needed)


def test_reference_path_matches_plain_reference_exactly(torch_mode):
    """Through the custom ops (as under torch.compile) the reference gives autograd's gradients bit for bit."""
    inp = ssd_inputs(2, 13, 4, 3, 2, 5, d_mode="chan", device="cpu")
    inp = cast_inputs(inp, to=F64)
    sid = seq_from_starts([[4, 5], [8]], 13, device="cpu")
    for fn in (op_ssd, K.ssd):
        a = run_ssd(fn, inp, sid, chunk_size=4, dt_limit=(0.0, 2.0))
        b = run_ssd(R.ssd, inp, sid, chunk_size=4, dt_limit=(0.0, 2.0))
        for k in b:
            assert torch.equal(a[k], b[k]), k

    x = torch.randn(2, 9, 6, dtype=F64, requires_grad=True)
    w = torch.randn(6, 4, dtype=F64, requires_grad=True)
    bb = torch.randn(6, dtype=F64, requires_grad=True)
    st = torch.randn(2, 6, 3, dtype=F64, requires_grad=True)
    sid = seq_from_starts([[3], [1]], 9, device="cpu")
    outs = []
    for fn in (lambda *a: ops.causal_conv1d_op(*a, sid, "silu", True), lambda *a: R.causal_conv1d(
            *a, seq_idx=sid, return_final_state=True)):
        y, f = fn(x, w, bb, st)
        outs.append((y, f) + torch.autograd.grad((y * 1.7).sum() + (f * 0.3).sum(), (x, w, bb, st)))
    assert all(torch.equal(u, v) for u, v in zip(*outs))

    x = torch.randn(3, 8, dtype=F64, requires_grad=True)
    z = torch.randn(3, 8, dtype=F64, requires_grad=True)
    w = torch.randn(8, dtype=F64, requires_grad=True)
    ga = torch.autograd.grad(ops.gated_rmsnorm_op(x, z, w, 2, 1e-5, False).pow(2).sum(), (x, z, w))
    gb = torch.autograd.grad(R.gated_rmsnorm(x, z, w, ngroups=2).pow(2).sum(), (x, z, w))
    assert all(torch.equal(u, v) for u, v in zip(ga, gb))
    r = torch.randn(3, 8, dtype=F64, requires_grad=True)
    oa, ra = ops.add_rmsnorm_op(x, r, w, 1e-5)
    ob, rb = R.add_rmsnorm(x, r, w)
    ga = torch.autograd.grad(oa.pow(2).sum() + ra.sum(), (x, r, w))
    gb = torch.autograd.grad(ob.pow(2).sum() + rb.sum(), (x, r, w))
    assert torch.equal(oa, ob) and torch.equal(ra, rb) and all(torch.equal(u, v) for u, v in zip(ga, gb))


def test_outputs_never_alias_inputs(torch_mode):
    x = torch.randn(2, 4)
    out, res = ops.add_rmsnorm_op(x, None, None, 1e-5)
    assert res.data_ptr() != x.data_ptr()
    torch.testing.assert_close(res, x)


def test_opcheck_custom_ops(torch_mode):
    inp = ssd_inputs(1, 6, 2, 2, 1, 3, d_mode="head", device="cpu")
    sid = seq_from_starts([[2]], 6, device="cpu")
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["dt_bias"], True,
            (0.0, 5.0), inp["initial_states"], sid, 4, True)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(ops.ssd_op, args, test_utils=tests)
    x = torch.randn(2, 5, 3)
    torch.library.opcheck(ops.causal_conv1d_op, (x, torch.randn(3, 4), torch.randn(3), torch.randn(2, 3, 3),
                                                 None, "silu", True), test_utils=tests)
    torch.library.opcheck(ops.gated_rmsnorm_op, (x, torch.randn(2, 5, 3), torch.randn(3), 1, 1e-5, False),
                          test_utils=tests)
    torch.library.opcheck(ops.rmsnorm_op, (x, torch.randn(3), 1e-5), test_utils=tests)
    torch.library.opcheck(ops.add_rmsnorm_op, (x, torch.randn(2, 5, 3), torch.randn(3), 1e-5), test_utils=tests)
    torch.library.opcheck(ops.swiglu_op, (x, torch.randn(2, 5, 3)), test_utils=tests)
    torch.library.opcheck(ops.ssd_step_op, (torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3), torch.randn(2, 2),
                                            -torch.rand(2), torch.randn(2, 1, 4), torch.randn(2, 1, 4), None,
                                            None, None, True, None), test_utils=tests)
    torch.library.opcheck(ops.causal_conv1d_step_op, (torch.randn(2, 3, 3), torch.randn(2, 3), torch.randn(3, 4),
                                                      None, "silu"), test_utils=tests)


def test_env_switch(monkeypatch):
    monkeypatch.setenv("MEGASSM_KERNELS", "bogus")
    with pytest.raises(ValueError, match="MEGASSM_KERNELS"):
        K.rmsnorm(torch.randn(2, 4), None)
    monkeypatch.setenv("MEGASSM_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="MEGASSM_KERNELS=triton"):
        K.rmsnorm(torch.randn(2, 4), None)
    monkeypatch.setenv("MEGASSM_KERNELS", "auto")
    assert not ops.use_triton(torch.randn(2))  # auto: CPU tensors use the reference
    monkeypatch.setenv("MEGASSM_KERNELS", "torch")
    assert K.backend() == "reference"


def test_backend_logged_once(caplog, monkeypatch, torch_mode):
    monkeypatch.setattr(K, "_announced", False)
    with caplog.at_level(logging.INFO, logger="megassm.kernels"):
        for _ in range(3):
            K.rmsnorm(torch.randn(2, 4), None)
            K.gated_rmsnorm(torch.randn(2, 4), None, None)
    msgs = [r.getMessage() for r in caplog.records if r.name == "megassm.kernels"]
    assert len(msgs) == 1 and "reference" in msgs[0]


@needs_triton
def test_triton_backend_log_names_the_ssd_precision(caplog, monkeypatch, triton_mode):
    """The one Triton announcement says which SSD precision mode bf16 inputs get (the default is bf16)."""
    monkeypatch.setattr(K, "_announced", False)
    monkeypatch.delenv("MEGASSM_SSD_PRECISION", raising=False)
    with caplog.at_level(logging.INFO, logger="megassm.kernels"):
        K.rmsnorm(torch.randn(2, 4), None)
    msgs = [r.getMessage() for r in caplog.records if r.name == "megassm.kernels"]
    assert len(msgs) == 1 and "Triton" in msgs[0] and "MEGASSM_SSD_PRECISION=bf16" in msgs[0], msgs


def test_compile_sees_one_op(torch_mode):
    inp = ssd_inputs(1, 8, 2, 4, 1, 4, device="cpu")

    def f(x, dt, A, B, C):
        return K.ssd(x, dt, A, B, C, chunk_size=4)

    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), f(*args))


@needs_triton
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("features", ["plain", "init_seq"])
def test_conv_triton(triton_mode, width, features):
    g = torch.Generator().manual_seed(width)
    bsz, seqlen, ch = 2, 19, 24
    base = torch.randn(bsz, seqlen, ch + 5, generator=g).to(DEV)
    x = base[..., 2:2 + ch]  # strided, as the in_proj split produces
    w = torch.randn(ch, width, generator=g).to(DEV)
    b = torch.randn(ch, generator=g).to(DEV)
    init = torch.randn(bsz, ch, width - 1, generator=g).to(DEV) if features == "init_seq" else None
    sid = seq_from_starts([[1, 2, 9], [18]], seqlen) if features == "init_seq" else None
    outs = []
    for fn in (K.causal_conv1d, R.causal_conv1d):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b) + ((init,) if init is not None else ())]
        y, f = fn(leaves[0], leaves[1], leaves[2], leaves[3] if init is not None else None, sid,
                  return_final_state=True)
        gg = torch.Generator().manual_seed(0)
        gy, gf = torch.randn(y.shape, generator=gg).to(DEV), torch.randn(f.shape, generator=gg).to(DEV)
        outs.append((y, f) + torch.autograd.grad((y, f), leaves, (gy, gf)))
    for u, v in zip(*outs):
        assert rel(u, v) < 1e-5


@needs_triton
def test_conv_triton_bf16_and_no_activation(triton_mode):
    x = torch.randn(2, 21, 16).to(DEV)
    w, b = torch.randn(16, 4).to(DEV), torch.randn(16).to(DEV)
    y = K.causal_conv1d(x.bfloat16(), w, b)
    yr = R.causal_conv1d(x.bfloat16(), w, b)
    y64 = R.causal_conv1d(x.bfloat16().double(), w.double(), b.double())
    assert y.dtype == torch.bfloat16
    assert rel(y, y64) <= (3 if INTERP else 2) * rel(yr, y64) + 1e-5
    torch.testing.assert_close(K.causal_conv1d(x, w, None, activation=None), R.causal_conv1d(x, w, None, activation=None))


# --------------------------------------------------------------------------------------------------------
# conv backward: every feature against the reference at small tiles (several blocks and programs per row), and
# bit for bit against the kernel it replaced


def _conv_bwd_case(width, dtype, *, seq, init, dfin, bias, silu, seqlen=None, ch=13, bl=4, seed=0):
    """Strided x / dy / initial_state. Input positions -(W-1) .. L-1 in blocks of bl = 4 starting at 4 i - (W-1),
    the last one partial (L + W-1 = 39 .. 41 by default). The documents start at position 1 (a first document of
    one token), exactly on a block start, inside a block, twice in a row (a document of one token) and on the
    last token."""
    seqlen = seqlen or 37 + (width == 4)
    g = torch.Generator().manual_seed(seed + 10 * width)
    rn = lambda *sh: torch.randn(*sh, generator=g)  # noqa: E731
    x = rn(2, seqlen, ch + 5)[..., 3:3 + ch].to(dtype).to(DEV)
    w = (rn(ch, width) * 0.5).to(DEV)
    b = rn(ch).to(DEV) if bias else None
    st = rn(2, width - 1, ch).to(dtype).to(DEV).transpose(1, 2) if init else None  # [B, C, W-1], stride 1 on C
    edge = 2 * bl - (width - 1)
    sid = seq_from_starts([[1, edge, edge + 2, 5 * bl - (width - 1), 5 * bl - (width - 1) + 1, seqlen - 1],
                           [bl + 1, seqlen - 2]], seqlen) if seq else None
    gy = rn(2, ch, seqlen).to(dtype).to(DEV).transpose(1, 2)  # dy [B, L, C] with channel stride L
    gf = rn(2, ch, width - 1).to(DEV) if dfin else None
    return x, w, b, st, sid, silu, gy, gf


def _conv_bwd_triton(tc, case, tiles, mode=None):
    x, w, b, st, sid, silu, gy, gf = case
    return tc.causal_conv1d_bwd(x, w, b, st, sid, silu, gy, gf, tiles=tiles, mode=mode)


def _conv_bwd_reference(case, dt=None):
    """Autograd through the reference (inputs cast to dt, if given): (dx, dweight, dbias, d initial_state)."""
    x, w, b, st, sid, silu, gy, gf = case
    cast = lambda t: None if t is None else t.detach().to(dt or t.dtype).requires_grad_(True)  # noqa: E731
    lv = [cast(t) for t in (x, w, b, st)]
    out = R.causal_conv1d(lv[0], lv[1], lv[2], lv[3], sid, activation="silu" if silu else None,
                          return_final_state=gf is not None)
    outs, grads = (out, (gy, gf)) if gf is not None else ((out,), (gy,))
    got = iter(torch.autograd.grad(outs, [t for t in lv if t is not None],
                                   [g.to(dt or g.dtype) for g in grads]))
    return tuple(None if t is None else next(got) for t in lv)


_CONV_BWD_FEATURES = {
    "all": dict(seq=True, init=True, dfin=True, bias=True, silu=True),
    "plain": dict(seq=False, init=False, dfin=False, bias=False, silu=False),
    "seq_nobias": dict(seq=True, init=False, dfin=True, bias=False, silu=True),
    "seq_nosilu": dict(seq=True, init=True, dfin=False, bias=True, silu=False),
    "init_dfin": dict(seq=False, init=True, dfin=True, bias=True, silu=True),
}


_F32, _BF16 = torch.float32, torch.bfloat16
_CONV_BWD_GRID = [
    *[(4, f, d) for f in _CONV_BWD_FEATURES for d in (_F32, _BF16)],
    (3, "all", _F32), (3, "seq_nosilu", _F32), (3, "plain", _F32), (3, "all", _BF16),
    (2, "all", _F32), (2, "seq_nobias", _F32), (2, "init_dfin", _F32), (2, "all", _BF16),
    (1, "all", _F32), (1, "plain", _F32), (1, "all", _BF16),
]


def _case_id(v):
    return str(v).replace("torch.", "")


# two_pass over the whole grid; fused at the widest case (elsewhere it is two_pass's bits: the bitwise test below)
_CONV_BWD_MODE_GRID = [(*c, "two_pass") for c in _CONV_BWD_GRID] + [(4, "all", d, "fused") for d in (_F32, _BF16)]


@needs_triton
@pytest.mark.parametrize("width,features,dtype,mode", _CONV_BWD_MODE_GRID, ids=_case_id)
def test_conv_bwd_triton_features(triton_mode, width, features, dtype, mode):
    """dx, dweight, dbias, d initial_state vs the reference; tiles (4, 16): L and C = 13 are not multiples, and
    the 10 or 11 input blocks of a row take two programs (two dweight partials per row, the second one running
    past the end)."""
    from megassm.kernels.triton import conv as tc

    case = _conv_bwd_case(width, dtype, **_CONV_BWD_FEATURES[features])
    got = _conv_bwd_triton(tc, case, (4, 16, 4), mode)
    oracle = _conv_bwd_reference(case, F64)
    if dtype == torch.float32:
        for name, u, v in zip(("dx", "dweight", "dbias", "dinit"), got, oracle):
            assert (u is None) == (v is None), name
            if u is not None and v.numel():
                assert rel(u, v) < 1e-5, name
        return
    ref = _conv_bwd_reference(case)  # the reference on the same bf16 inputs: its own bf16 error
    for name, u, r, v in zip(("dx", "dweight", "dbias", "dinit"), got, ref, oracle):
        assert (u is None) == (v is None) and (u is None or u.dtype == r.dtype), name
        if u is not None and v.numel():
            assert rel(u, v) <= (3 if INTERP else 2) * rel(r, v) + 1e-5, name


# The backward kernel as it was before it loaded each shifted x / seq_idx tile once per block (commit 247b43f,
# kernels/triton/conv.py: _conv_bwd_kernel and its helpers, renamed): the oracle of the bitwise test below.
if HAS_TRITON:
    try:
        import triton
        import triton.language as tl

        from megassm.kernels.triton._lang import tsigmoid, tsum
    except Exception:  # pragma: no cover - kernels/triton not importable: triton_mode skips the test
        triton = None
else:
    triton = None

if triton is not None:

    @triton.jit
    def _old_load_in(X, INIT, b, pos, c, mask_c, L, sxb, sxl, sxc, sib, sic, sil, W: tl.constexpr,
                     HAS_INIT: tl.constexpr):
        in_x = (pos >= 0) & (pos < L)
        pos_x = tl.where(in_x, pos, 0)
        v = tl.load(X + b * sxb + pos_x[:, None] * sxl + c[None, :] * sxc, mask=in_x[:, None] & mask_c[None, :],
                    other=0.0).to(tl.float32)
        if HAS_INIT:
            j = pos + (W - 1)
            in_i = (pos < 0) & (j >= 0)
            j = tl.where(in_i, j, 0)
            v += tl.load(INIT + b * sib + c[None, :] * sic + j[:, None] * sil,
                         mask=in_i[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        return v


    @triton.jit
    def _old_load_seq(SEQ, b, pos, L, ssb, ssl):
        p = tl.minimum(tl.maximum(pos, 0), L - 1)
        return tl.load(SEQ + b * ssb + p * ssl)


    @triton.jit
    def _old_pre(X, INIT, SEQ, WT, BIAS, b, t, c, mask_c, L, sxb, sxl, sxc, sib, sic, sil, ssb, ssl, swc, sww,
                 W: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BL: tl.constexpr, BC: tl.constexpr):
        acc = tl.full([BL, BC], 0.0, tl.float32)
        if HAS_SEQ:
            st = _old_load_seq(SEQ, b, t, L, ssb, ssl)
        for k in tl.static_range(W):
            pos = t - (W - 1) + k
            v = _old_load_in(X, INIT, b, pos, c, mask_c, L, sxb, sxl, sxc, sib, sic, sil, W, HAS_INIT)
            if HAS_SEQ:
                v = tl.where((_old_load_seq(SEQ, b, pos, L, ssb, ssl) == st)[:, None], v, 0.0)
            wk = tl.load(WT + c * swc + k * sww, mask=mask_c, other=0.0).to(tl.float32)
            acc += v * wk[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
        return acc


    @triton.jit
    def _old_conv_bwd_kernel(X, INIT, SEQ, WT, BIAS, DY, DFIN, DX, DINIT, DW_PART, DB_PART, L, C, n_sblocks,
                             sb_per_prog, n_prog_l, sxb, sxl, sxc, sib, sic, sil, ssb, ssl, swc, sww, sdyb, sdyl,
                             sdyc, sfb, sfc, sfl, W: tl.constexpr, WP: tl.constexpr, HAS_INIT: tl.constexpr,
                             HAS_SEQ: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                             HAS_DFIN: tl.constexpr, WANT_DINIT: tl.constexpr, BL: tl.constexpr, BC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        pl = tl.program_id(1)
        c = tl.program_id(2) * BC + tl.arange(0, BC)
        mask_c = c < C
        kk = tl.arange(0, WP)
        dw_acc = tl.full([WP, BC], 0.0, tl.float32)
        db_acc = tl.full([BC], 0.0, tl.float32)
        for i in range(sb_per_prog):
            sblk = pl * sb_per_prog + i
            s = sblk * BL - (W - 1) + tl.arange(0, BL)  # input positions handled here (none past the end)
            if HAS_SEQ:
                seq_s = _old_load_seq(SEQ, b, s, L, ssb, ssl)
            dx = tl.full([BL, BC], 0.0, tl.float32)
            for m in tl.static_range(W):
                t = s + m  # output position fed by input s through tap k = W-1-m
                valid_t = (t >= 0) & (t < L)
                t_c = tl.where(valid_t, t, 0)
                dy = tl.load(DY + b * sdyb + t_c[:, None] * sdyl + c[None, :] * sdyc,
                             mask=valid_t[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
                if SILU:
                    pre = _old_pre(X, INIT, SEQ, WT, BIAS, b, t, c, mask_c, L, sxb, sxl, sxc, sib, sic, sil, ssb,
                                   ssl, swc, sww, W, HAS_INIT, HAS_SEQ, HAS_BIAS, BL, BC)
                    sg = tsigmoid(pre)
                    dpre = dy * sg * (1.0 + pre * (1.0 - sg))
                else:
                    dpre = dy
                wk = tl.load(WT + c * swc + (W - 1 - m) * sww, mask=mask_c, other=0.0).to(tl.float32)
                contrib = dpre * wk[None, :]
                if HAS_SEQ:
                    same = _old_load_seq(SEQ, b, t, L, ssb, ssl) == seq_s
                    contrib = tl.where(same[:, None], contrib, 0.0)
                dx += contrib
                if m == 0:
                    # weight / bias gradients over the output positions t = s of this block
                    db_acc += tsum(dpre, 0)
                    if HAS_SEQ:
                        st = _old_load_seq(SEQ, b, t, L, ssb, ssl)
                    for k in tl.static_range(W):
                        pos = t - (W - 1) + k
                        v = _old_load_in(X, INIT, b, pos, c, mask_c, L, sxb, sxl, sxc, sib, sic, sil, W, HAS_INIT)
                        if HAS_SEQ:
                            v = tl.where((_old_load_seq(SEQ, b, pos, L, ssb, ssl) == st)[:, None], v, 0.0)
                        dwk = tsum(dpre * v, 0)
                        dw_acc += tl.where(kk[:, None] == k, dwk[None, :], 0.0)
            if HAS_DFIN:
                # final_state[:, :, j] is input position L-(W-1)+j (zeroed if of an earlier document than the last)
                j = s - (L - (W - 1))
                in_f = (j >= 0) & (j < W - 1)
                jc = tl.where(in_f, j, 0)
                df = tl.load(DFIN + b * sfb + c[None, :] * sfc + jc[:, None] * sfl,
                             mask=in_f[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
                if HAS_SEQ:
                    same_last = (_old_load_seq(SEQ, b, s, L, ssb, ssl)
                                 == _old_load_seq(SEQ, b, s * 0 + (L - 1), L, ssb, ssl))
                    df = tl.where(same_last[:, None], df, 0.0)
                dx += df
            in_x = (s >= 0) & (s < L)
            s_x = tl.where(in_x, s, 0)
            tl.store(DX + b * L * C + s_x[:, None] * C + c[None, :], dx.to(DX.dtype.element_ty),
                     mask=in_x[:, None] & mask_c[None, :])
            if WANT_DINIT:
                jj = s + (W - 1)
                in_i = (s < 0) & (jj >= 0)
                jj = tl.where(in_i, jj, 0)
                tl.store(DINIT + b * C * (W - 1) + c[None, :] * (W - 1) + jj[:, None], dx,
                         mask=in_i[:, None] & mask_c[None, :])
        part = b * n_prog_l + pl
        if HAS_BIAS:
            tl.store(DB_PART + part * C + c, db_acc, mask=mask_c)
        tl.store(DW_PART + (part * W + kk[:, None]) * C + c[None, :], dw_acc,
                 mask=(kk < W)[:, None] & mask_c[None, :])


_CONV_BWD_BITWISE_GRID = [
    (4, "all", 37, 13, (4, 16, 4)),
    (4, "seq_nobias", 70, 24, (16, 16, 4)),
    (3, "init_dfin", 21, 9, (8, 16, 4)),
    (2, "seq_nosilu", 37, 13, (4, 16, 4)),
    (4, "all", 23, 40, None),
    (1, "all", 11, 6, (4, 8, 4)),
]


@needs_triton
@pytest.mark.parametrize("width,features,seqlen,ch,tiles,dtype", [
    (*_CONV_BWD_BITWISE_GRID[0], _F32), (*_CONV_BWD_BITWISE_GRID[0], _BF16), (*_CONV_BWD_BITWISE_GRID[3], _F32),
    (*_CONV_BWD_BITWISE_GRID[5], _F32)], ids=_case_id)  # the change it proved is GPU-tested since; a few cases stay
def test_conv_bwd_bitwise_equals_old_kernel(triton_mode, monkeypatch, width, features, seqlen, ch, tiles, dtype):
    """The restructured fused backward (each shifted tile loaded once, pre summed in _pre's order) gives exactly
    the old kernel's dx, dweight, dbias and d initial_state: same operations on the same values, in the same
    order."""
    from megassm.kernels.triton import conv as tc

    case = _conv_bwd_case(width, dtype, seqlen=seqlen, ch=ch, **_CONV_BWD_FEATURES[features])
    new = _conv_bwd_triton(tc, case, tiles, "fused")
    monkeypatch.setattr(tc, "_conv_bwd_kernel", _old_conv_bwd_kernel)
    old = _conv_bwd_triton(tc, case, tiles, "fused")
    for name, u, v in zip(("dx", "dweight", "dbias", "dinit"), new, old):
        assert (u is None) == (v is None), name
        if u is not None:
            assert u.dtype == v.dtype and torch.equal(u, v), name


@needs_triton
@pytest.mark.skipif(not INTERP, reason="bitwise only in the interpreter: on a GPU the compiler may contract the "
                    "two kernels' multiply-adds into FMAs differently (last-bit differences)")
@pytest.mark.parametrize("dtype", [_F32, _BF16], ids=_case_id)
@pytest.mark.parametrize("width,features,seqlen,ch,tiles", [*_CONV_BWD_BITWISE_GRID,
                                                            (4, "all", 37, 13, ((4, 16, 4), (8, 8, 4))),
                                                            (3, "seq_nosilu", 30, 20, ((8, 16, 4), (4, 32, 4)))])
def test_conv_bwd_two_pass_bitwise_equals_fused(triton_mode, width, features, seqlen, ch, tiles, dtype):
    """The two-pass backward gives the fused kernel's dx, dweight, dbias and d initial_state bit for bit: pass 1
    walks the fused kernel's blocks with its m == 0 operations, pass 2 sums dx in its order. With tiles=None
    (the passes at their default tiles) or a pair (pass 1's, pass 2's), the fused kernel runs at pass 1's tiles:
    dweight's summation order depends on the position blocks, dx and d initial_state on no tile."""
    from megassm.kernels.triton import conv as tc

    case = _conv_bwd_case(width, dtype, seqlen=seqlen, ch=ch, **_CONV_BWD_FEATURES[features])
    two = _conv_bwd_triton(tc, case, tiles, "two_pass")
    if tiles is None:
        tiles = tc._two_pass_tiles(seqlen + width - 1, ch)
    fused = _conv_bwd_triton(tc, case, tiles[0] if isinstance(tiles[0], tuple) else tiles, "fused")
    for name, u, v in zip(("dx", "dweight", "dbias", "dinit"), two, fused):
        assert (u is None) == (v is None), name
        if u is not None:
            assert u.dtype == v.dtype and torch.equal(u, v), name


@needs_triton
def test_conv_bwd_mode_switch(triton_mode, monkeypatch):
    """MEGASSM_CONV_BWD picks the backward (fused when unset or empty, two_pass) when mode is None; mode= wins
    over it; two_pass takes a pair of tiles (pass 1's, pass 2's); a bad value fails naming the variable
    (env.check too) or the argument."""
    from megassm.kernels import env
    from megassm.kernels.triton import conv as tc

    class Unlaunchable:
        def __getitem__(self, grid):
            raise AssertionError("this kernel must not run in this mode")

    off = {"two_pass": ("_conv_bwd_kernel",), "fused": ("_conv_dpre_kernel", "_conv_dx_kernel")}
    case = _conv_bwd_case(2, _F32, seqlen=9, ch=5, **_CONV_BWD_FEATURES["all"])
    refs = {mode: _conv_bwd_triton(tc, case, (4, 8, 4), mode) for mode in off}
    for value, mode in ((None, "fused"), ("", "fused"), (" Two_Pass", "two_pass"), ("fused", "fused")):
        if value is None:
            monkeypatch.delenv("MEGASSM_CONV_BWD", raising=False)
        else:
            monkeypatch.setenv("MEGASSM_CONV_BWD", value)
        env.check()
        with monkeypatch.context() as m:
            for name in off[mode]:
                m.setattr(tc, name, Unlaunchable())
            got = _conv_bwd_triton(tc, case, (4, 8, 4))
        assert all(torch.equal(u, v) for u, v in zip(got, refs[mode])), value
    with monkeypatch.context() as m:  # the argument over the switch (fused set above)
        m.setattr(tc, "_conv_bwd_kernel", Unlaunchable())
        got = _conv_bwd_triton(tc, case, ((4, 8, 4), (8, 4, 4)), "two_pass")  # pass 2's tiles change no bits
        assert all(torch.equal(u, v) for u, v in zip(got, refs["two_pass"]))
    with pytest.raises(ValueError, match="for mode two_pass only"):
        _conv_bwd_triton(tc, case, ((4, 8, 4), (8, 4, 4)), "fused")
    with pytest.raises(ValueError, match="mode='both'"):
        _conv_bwd_triton(tc, case, (4, 8, 4), "both")
    monkeypatch.setenv("MEGASSM_CONV_BWD", "both")
    with pytest.raises(ValueError, match="MEGASSM_CONV_BWD='both'"):
        _conv_bwd_triton(tc, case, (4, 8, 4))
    with pytest.raises(ValueError, match="MEGASSM_CONV_BWD='both'"):
        env.check()


@needs_triton
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("gate", [True, False])
def test_gated_rmsnorm_triton(triton_mode, norm_before_gate, gate):
    x = torch.randn(3, 5, 48).to(DEV)
    z = torch.randn(3, 5, 48).to(DEV) if gate else None
    w = torch.randn(48).to(DEV)
    outs = []
    for fn in (K.gated_rmsnorm, R.gated_rmsnorm):
        leaves = [t.clone().requires_grad_(True) for t in (x, w) + ((z,) if gate else ())]
        o = fn(leaves[0], leaves[2] if gate else None, leaves[1], ngroups=4, norm_before_gate=norm_before_gate)
        gr = torch.autograd.grad(o, leaves, torch.ones_like(o) * torch.linspace(-1, 1, 48, device=DEV))
        outs.append((o,) + gr)
    for u, v in zip(*outs):
        assert rel(u, v) < 1e-5


@needs_triton
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("gate", [True, False])
def test_gated_rmsnorm_stages_over_split_groups(triton_mode, norm_before_gate, gate):
    """The staged gated norm (tensor parallelism with fewer groups than ranks): each group's channels split over
    two 'devices', sumsq and dot summed between the stages, gives gated_rmsnorm's output and gradients on both
    backends; x and z are strided rows (slices of one wider tensor, as Mamba-2's z is of in_proj's output)."""
    G, D, h = 2, 48, 12  # 2 groups of 24 channels, 12 on each device
    wide = torch.randn(3, 5, 3 * D).to(DEV)
    x, z = wide[..., :D], (wide[..., D:2 * D] if gate else None)
    w, dout = torch.randn(D).to(DEV), torch.randn(3, 5, D).to(DEV)
    leaves = [t.clone().requires_grad_(True) for t in (x, w) + ((z,) if gate else ())]
    ref = R.gated_rmsnorm(leaves[0], leaves[2] if gate else None, leaves[1], ngroups=G,
                          norm_before_gate=norm_before_gate)
    want = (ref,) + torch.autograd.grad(ref, leaves, dout)

    def part(t, q):  # device q's channels of every group
        return None if t is None else t.unflatten(-1, (G, 2, h))[..., q, :].flatten(-2)

    def whole(ts):
        return torch.stack([t.unflatten(-1, (G, h)) for t in ts], -2).flatten(-3)

    for lib in (K, R):
        dev = [(part(x, q), part(z, q), part(w, q), part(dout, q)) for q in range(2)]
        ss = sum(lib.gated_rmsnorm_sumsq(a, b, G, norm_before_gate) for a, b, _, _ in dev)
        out = whole([lib.gated_rmsnorm_apply(a, b, c, ss, 2 * h, 1e-5, norm_before_gate) for a, b, c, _ in dev])
        dot = sum(lib.gated_rmsnorm_bwd_dot(e, a, b, c, ss, 2 * h, 1e-5, norm_before_gate) for a, b, c, e in dev)
        grads = [lib.gated_rmsnorm_bwd_apply(e, a, b, c, ss, dot, 2 * h, 1e-5, norm_before_gate)
                 for a, b, c, e in dev]
        got = (out, whole([g[0] for g in grads]), whole([g[2][None] for g in grads])[0])
        if gate:
            got += (whole([g[1] for g in grads]),)
        assert ss.shape == (3, 5, G) and ss.dtype == torch.float32
        for u, v in zip(got, want):
            assert rel(u, v) < 1e-5


@needs_triton
@pytest.mark.parametrize("slot", [0, 1])
def test_gated_rmsnorm_stages_read_strided_statistics(triton_mode, slot):
    """TP with 2 norm groups over 4 ranks: a rank's statistics are one column (its group's slot) of the
    all-reduced [..., 2] buffer; the kernels read it in place and write their own sums densely."""
    g = torch.Generator().manual_seed(slot)
    x, z, do = (torch.randn(2, 16, 12, generator=g).to(DEV) for _ in range(3))
    w = torch.randn(12, generator=g).to(DEV)

    def column(t):  # t [..., 1] in `slot` of a [..., 2] buffer (the other group's slot holds other numbers)
        return torch.cat([t * 2.0, t + 1.0] if slot == 0 else [t + 1.0, t * 2.0], -1)[..., slot:slot + 1]

    outs = []
    for lib in (K, R):
        ss = lib.gated_rmsnorm_sumsq(x, z, 1, False)
        assert ss.shape == (2, 16, 1) and ss.is_contiguous()
        ssc = column(ss)
        out = lib.gated_rmsnorm_apply(x, z, w, ssc, 24, 1e-5, False)
        dot = column(lib.gated_rmsnorm_bwd_dot(do, x, z, w, ssc, 24, 1e-5, False))
        outs.append((ss, out, dot) + lib.gated_rmsnorm_bwd_apply(do, x, z, w, ssc, dot, 24, 1e-5, False))
    for u, v in zip(*outs):
        assert rel(u, v) < 1e-5


@needs_triton
def test_rmsnorm_and_add_rmsnorm_triton(triton_mode):
    x = torch.randn(4, 3, 40).to(DEV)
    w = torch.randn(40).to(DEV)
    xs = [t.clone().requires_grad_(True) for t in (x, w)]
    xr = [t.clone().requires_grad_(True) for t in (x, w)]
    o, o2 = K.rmsnorm(*xs), R.rmsnorm(*xr)
    ga, gb = torch.autograd.grad(o.pow(2).sum(), xs), torch.autograd.grad(o2.pow(2).sum(), xr)
    assert rel(o, o2) < 1e-5 and all(rel(u, v) < 1e-5 for u, v in zip(ga, gb))
    for res_dtype in (None, torch.float32):
        xb = x.bfloat16()
        r = torch.randn(4, 3, 40).to(DEV) if res_dtype else None
        outs = []
        for fn in (K.add_rmsnorm, R.add_rmsnorm):
            lv = [xb.clone().requires_grad_(True), w.clone().requires_grad_(True)]
            rr = r.clone().requires_grad_(True) if r is not None else None
            out, nres = fn(lv[0], rr, lv[1])
            ins = lv + ([rr] if rr is not None else [])
            gr = torch.autograd.grad((out.float().pow(2).sum() + nres.sin().sum()), ins)
            outs.append((out, nres) + gr)
        assert outs[0][0].dtype == torch.bfloat16 and outs[0][1].dtype == torch.float32
        torch.testing.assert_close(outs[0][1], outs[1][1])
        for u, v in zip(outs[0], outs[1]):
            assert rel(u, v) < 1e-2  # bf16 output rounding feeds every gradient here


@needs_triton
def _swiglu_grads(fn, a, b, dh):
    lv = [a.clone().requires_grad_(True), b.clone().requires_grad_(True)]
    h = fn(*lv)
    return (h,) + torch.autograd.grad(h, lv, dh)


@pytest.mark.parametrize("shape", [(3, 5, 37), (2, 3, 700)], ids=["one-block", "three-blocks"])
def test_swiglu_triton(triton_mode, shape):
    """silu(a) * b and both gradients: fp32 equal to the reference; bf16 (one rounding instead of torch's two)
    at least as close to an fp64 oracle as the reference on the GPU (Triton's CPU interpreter truncates its bf16
    stores instead of rounding: 2x there); strided inputs (a slice) taken."""
    g = torch.Generator().manual_seed(0)
    a, b, dh = (torch.randn(*shape, generator=g).mul(3).to(DEV) for _ in range(3))
    ours, ref = _swiglu_grads(K.swiglu, a, b, dh), _swiglu_grads(R.swiglu, a, b, dh)
    for u, v in zip(ours, ref):
        assert u.dtype == torch.float32 and rel(u, v) < 1e-6
    oracle = _swiglu_grads(R.swiglu, a.double(), b.double(), dh.double())
    lo = [t.bfloat16() for t in (a, b, dh)]
    ours, ref = _swiglu_grads(K.swiglu, *lo), _swiglu_grads(R.swiglu, *lo)
    factor = 2.0 if INTERP else 1.05
    for u, v, o in zip(ours, ref, oracle):
        assert u.dtype == torch.bfloat16 and rel(u, o) <= rel(v, o) * factor + 1e-6, (rel(u, o), rel(v, o))
    wide = torch.randn(shape[0], shape[1], 2 * shape[2], generator=g).to(DEV)
    sa, sb = wide[..., : shape[2]], wide[..., shape[2]:]  # strided halves
    ours, ref = _swiglu_grads(K.swiglu, sa, sb, dh), _swiglu_grads(R.swiglu, sa, sb, dh)
    assert all(rel(u, v) < 1e-6 for u, v in zip(ours, ref))


def test_swiglu_refuses_mismatched_shapes(torch_mode):
    with pytest.raises(ValueError, match=r"swiglu: a \(2, 3\) and b \(2, 4\)"):
        K.swiglu(torch.randn(2, 3), torch.randn(2, 4))


@pytest.mark.parametrize("d_mode", ["head", "chan"])
def test_step_kernels_triton(triton_mode, d_mode):
    g = torch.Generator().manual_seed(3)
    bsz, nh, hd, ng, ds = 2, 4, 16, 2, 16
    rn = lambda *s: torch.randn(*s, generator=g).to(DEV)  # noqa: E731
    state, x, dt = rn(bsz, nh, hd, ds), rn(bsz, nh, hd), rn(bsz, nh)
    A = -torch.rand(nh, generator=g).to(DEV) - 0.1
    Bm, Cm, z = rn(bsz, ng, ds), rn(bsz, ng, ds), rn(bsz, nh, hd)
    D = rn(nh) if d_mode == "head" else rn(nh, hd)
    kw = dict(D=D, z=z, dt_bias=rn(nh), dt_limit=(0.0, 2.0))
    y, new = K.ssd_step(state, x, dt, A, Bm, Cm, **kw)
    y2, new2 = R.ssd_step(state, x, dt, A, Bm, Cm, **kw)
    assert rel(y, y2) < 1e-5 and rel(new, new2) < 1e-5 and new.dtype == torch.float32
    cs, xc, w, b = rn(bsz, 24, 3), rn(bsz, 24), rn(24, 4), rn(24)
    for act in ("silu", None):
        yc, nc = K.causal_conv1d_step(cs, xc.bfloat16(), w, b, activation=act)
        yc2, nc2 = R.causal_conv1d_step(cs, xc.bfloat16(), w, b, activation=act)
        assert yc.dtype == torch.bfloat16 and nc.dtype == torch.float32
        torch.testing.assert_close(nc, nc2)
        assert rel(yc, yc2) < 1e-2


@needs_triton
def test_model_trains_identically_on_triton_kernels(triton_mode, monkeypatch):
    """A tiny Mamba-2 + MLP model (strided in_proj splits, packed documents, carried states) gives the same
    logits, final states and parameter gradients on the Triton kernels as on the references."""
    from megassm.config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig
    from megassm.models import build_model

    cfg = ModelConfig(pattern="M-", d_model=32,
                      mamba=MambaConfig(d_state=16, headdim=16, chunk_size=16, ngroups=2),
                      attn=AttentionConfig(n_heads=4, n_kv_heads=2), mlp=MLPConfig(ffn_hidden=48))
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0)).to(DEV)
    sid = seq_from_starts([[16], [7, 8]], 24)
    res = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("MEGASSM_KERNELS", mode)
        m = build_model(cfg, vocab_size=97)
        m.init_weights(0)
        m = m.to(DEV).train()
        out = m(ids, seq_idx=sid, return_states=True)
        loss = out.logits.float().pow(2).mean()
        loss.backward()
        res[mode] = (out.logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    (la, ga), (lb, gb) = res["torch"], res["triton"]
    assert rel(lb, la) < 1e-5
    assert ga.keys() == gb.keys()
    for k in ga:
        assert rel(gb[k], ga[k]) < 1e-4, k


# --------------------------------------------------------------------------------------------------------
# GPU: conv and norms at real shapes (pytest -m gpu)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_conv_and_norms_real_shapes(triton_mode, dtype):
    bsz, seqlen, ch = 2, 2048, 4096 + 2 * 128
    x = torch.randn(bsz, seqlen, ch + 64, device="cuda")[..., :ch].to(dtype)
    w, b = torch.randn(ch, 4, device="cuda") * 0.3, torch.randn(ch, device="cuda")
    init = torch.randn(bsz, ch, 3, device="cuda")
    sid = seq_from_starts(reset_starts(seqlen, 256, bsz), seqlen, device="cuda")
    res = []
    for fn in (K.causal_conv1d, R.causal_conv1d):
        lv = [t.detach().clone().requires_grad_(True) for t in (x, w, b, init)]
        y, f = fn(*lv, sid, return_final_state=True)
        res.append((y, f) + torch.autograd.grad((y.float().sum() + f.sum()), lv))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for u, v in zip(*res):
        assert rel(u, v) < tol
    d = 4096
    xn, zn = torch.randn(bsz, seqlen, d, device="cuda").to(dtype), torch.randn(bsz, seqlen, d, device="cuda").to(dtype)
    wn = torch.randn(d, device="cuda")
    res = []
    for fn in (K.gated_rmsnorm, R.gated_rmsnorm):
        lv = [t.clone().requires_grad_(True) for t in (xn, zn, wn)]
        o = fn(lv[0], lv[1], lv[2], ngroups=8)
        res.append((o,) + torch.autograd.grad(o.float().pow(2).sum(), lv))
    for u, v in zip(*res):
        assert rel(u, v) < tol
    r = torch.randn(bsz, seqlen, d, device="cuda")
    res = []
    for fn in (K.add_rmsnorm, R.add_rmsnorm):
        lv = [t.clone().requires_grad_(True) for t in (xn, r, wn)]
        o, nr = fn(*lv)
        res.append((o, nr) + torch.autograd.grad(o.float().pow(2).sum() + nr.sum(), lv))
    for u, v in zip(*res):
        assert rel(u, v) < tol


@gpu
@needs_cuda
def test_gpu_swiglu_real_shapes(triton_mode):
    """hybrid-1.3b's MLP at micro-batch 4 x 2048 (hidden 5632), bf16: each gradient at least as close to fp64 as
    torch's own bf16 path."""
    a, b, dh = (torch.randn(4, 2048, 5632, device="cuda") * 2 for _ in range(3))
    oracle = _swiglu_grads(R.swiglu, a.double(), b.double(), dh.double())
    lo = [t.bfloat16() for t in (a, b, dh)]
    ours, ref = _swiglu_grads(K.swiglu, *lo), _swiglu_grads(R.swiglu, *lo)
    for u, v, o in zip(ours, ref, oracle):
        assert rel(u, o) <= rel(v, o) * 1.05 + 1e-6, (rel(u, o), rel(v, o))
