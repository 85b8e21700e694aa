"""The Triton causal conv1d (kernels/conv1d/triton_conv.py) against the PyTorch reference: the forward and every gradient,
widths 1-4, strided inputs, initial states, document resets, fp32 and bf16; the backward's three modes
(MEGASSM_CONV_BWD: two_pass_defer, two_pass, fused) against the reference and against each other, and the fused
kernel against the one it replaced. Triton's CPU interpreter at tiny shapes in CI; the real shapes are in
test_kernels_triton.py's GPU tests. Shared setup and criteria: kernel_cases.py."""
import pytest
import torch

# kernel_cases sets TRITON_INTERPRET before the Triton kernels are first imported
from kernel_cases import DEV, F64, HAS_TRITON, INTERP, K, TRITON_WARNINGS, needs_triton, rel, seq_from_starts
from kernel_cases import triton_mode  # noqa: F401  (fixture)
from megassm.kernels.conv1d import reference as conv_ref

pytestmark = TRITON_WARNINGS

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
    for fn in (K.causal_conv1d, conv_ref.causal_conv1d):
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
    yr = conv_ref.causal_conv1d(x.bfloat16(), w, b)
    y64 = conv_ref.causal_conv1d(x.bfloat16().double(), w.double(), b.double())
    assert y.dtype == torch.bfloat16
    assert rel(y, y64) <= (3 if INTERP else 2) * rel(yr, y64) + 1e-5
    torch.testing.assert_close(K.causal_conv1d(x, w, None, activation=None), conv_ref.causal_conv1d(x, w, None, activation=None))


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
    out = conv_ref.causal_conv1d(lv[0], lv[1], lv[2], lv[3], sid, activation="silu" if silu else None,
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


# two_pass over the whole grid; fused at the widest case (elsewhere it is two_pass's bits: the bitwise test below);
# two_pass_defer at every width (its own dweight / dbias sums; widths above 4 sum as two_pass)
_CONV_BWD_MODE_GRID = ([(*c, "two_pass") for c in _CONV_BWD_GRID] + [(4, "all", d, "fused") for d in (_F32, _BF16)]
                       + [(w, f, d, "two_pass_defer") for w, f, d in [(4, "all", _F32), (4, "all", _BF16),
                                                                     (4, "plain", _F32), (3, "seq_nobias", _F32),
                                                                     (2, "init_dfin", _BF16), (1, "all", _F32)]])


@needs_triton
@pytest.mark.parametrize("width,features,dtype,mode", _CONV_BWD_MODE_GRID, ids=_case_id)
def test_conv_bwd_triton_features(triton_mode, width, features, dtype, mode):
    """dx, dweight, dbias, d initial_state vs the reference; tiles (4, 16): L and C = 13 are not multiples, and
    the 10 or 11 input blocks of a row take two programs (two dweight partials per row, the second one running
    past the end)."""
    from megassm.kernels.conv1d import triton_conv as tc

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
# kernels/conv1d/triton_conv.py: _conv_bwd_kernel and its helpers, renamed): the oracle of the bitwise test below.
if HAS_TRITON:
    try:
        import triton
        import triton.language as tl

        from megassm.kernels.common.lang import tsigmoid, tsum
    except Exception:  # pragma: no cover - triton not importable: triton_mode skips the test
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


    @triton.jit  # sdxb, sdxl (dx's strides, added later for out_dx) unused: the old kernel's dx is contiguous
    def _old_conv_bwd_kernel(X, INIT, SEQ, WT, BIAS, DY, DFIN, DX, DINIT, DW_PART, DB_PART, L, C, n_sblocks,
                             sb_per_prog, n_prog_l, sxb, sxl, sxc, sib, sic, sil, ssb, ssl, swc, sww, sdyb, sdyl,
                             sdyc, sfb, sfc, sfl, sdxb, sdxl, W: tl.constexpr, WP: tl.constexpr,
                             HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
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
    (*_CONV_BWD_BITWISE_GRID[3], _F32), (*_CONV_BWD_BITWISE_GRID[5], _F32)],
    ids=_case_id)  # the change it proved is GPU-tested since; two cheap cases stay (the widest took 15 s of CI)
def test_conv_bwd_bitwise_equals_old_kernel(triton_mode, monkeypatch, width, features, seqlen, ch, tiles, dtype):
    """The restructured fused backward (each shifted tile loaded once, pre summed in _pre's order) gives exactly
    the old kernel's dx, dweight, dbias and d initial_state: same operations on the same values, in the same
    order."""
    from megassm.kernels.conv1d import triton_conv as tc

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
    from megassm.kernels.conv1d import triton_conv as tc

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
@pytest.mark.parametrize("width,features,seqlen,ch,tiles", [(4, "all", 70, 24, (4, 16, 4)),
                                                            (4, "all", 70, 24, (4, 16, 4, 3)),
                                                            (3, "seq_nobias", 37, 13, ((8, 16, 4), (4, 32, 4))),
                                                            (5, "all", 23, 9, (4, 8, 4))], ids=_case_id)
def test_conv_bwd_two_pass_defer_against_two_pass(triton_mode, width, features, seqlen, ch, tiles):
    """two_pass_defer changes only where pass 1 reduces dweight / dbias: dx and d initial_state are two_pass's bit
    for bit, dweight / dbias the same terms summed in another order (fp32: within rounding of each other, and of
    the fp64 reference); at width 5 (above its four named accumulators) it is two_pass. A fourth tile entry
    (position blocks per program, here 3 of a row's 19) changes only how the partials are split."""
    from megassm.kernels.conv1d import triton_conv as tc

    case = _conv_bwd_case(width, _F32, seqlen=seqlen, ch=ch, **_CONV_BWD_FEATURES[features])
    late = _conv_bwd_triton(tc, case, tiles, "two_pass_defer")
    per_block = _conv_bwd_triton(tc, case, tiles, "two_pass")
    oracle = _conv_bwd_reference(case, F64)
    for name, u, v, o in zip(("dx", "dweight", "dbias", "dinit"), late, per_block, oracle):
        assert (u is None) == (v is None) == (o is None), name
        if u is None:
            continue
        assert rel(u, o) < 1e-5, name
        if name in ("dx", "dinit") or width > 4:
            assert torch.equal(u, v), name
        else:
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6, msg=name)


@needs_triton
def test_conv_bwd_mode_switch(triton_mode, monkeypatch):
    """MEGASSM_CONV_BWD picks the backward (two_pass_defer when unset or empty, two_pass, fused) when mode is
    None; mode= wins over it; two_pass takes a pair of tiles (pass 1's, pass 2's); a bad value fails naming the
    variable (env.check too) or the argument."""
    from megassm.kernels import env
    from megassm.kernels.conv1d import triton_conv as tc

    class Unlaunchable:
        def __getitem__(self, grid):
            raise AssertionError("this kernel must not run in this mode")

    off = {"two_pass": ("_conv_bwd_kernel",), "fused": ("_conv_dpre_kernel", "_conv_dx_kernel"),
           "two_pass_defer": ("_conv_bwd_kernel",)}
    case = _conv_bwd_case(2, _F32, seqlen=9, ch=5, **_CONV_BWD_FEATURES["all"])
    refs = {mode: _conv_bwd_triton(tc, case, (4, 8, 4), mode) for mode in off}
    for value, mode in ((None, "two_pass_defer"), ("", "two_pass_defer"), (" Two_Pass", "two_pass"),
                        ("fused", "fused"), ("two_pass_defer", "two_pass_defer")):
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
    with pytest.raises(ValueError, match="for the two_pass modes only"):
        _conv_bwd_triton(tc, case, ((4, 8, 4), (8, 4, 4)), "fused")
    with pytest.raises(ValueError, match="mode='both'"):
        _conv_bwd_triton(tc, case, (4, 8, 4), "both")
    monkeypatch.setenv("MEGASSM_CONV_BWD", "both")
    with pytest.raises(ValueError, match="MEGASSM_CONV_BWD='both'"):
        _conv_bwd_triton(tc, case, (4, 8, 4))
    with pytest.raises(ValueError, match="MEGASSM_CONV_BWD='both'"):
        env.check()
