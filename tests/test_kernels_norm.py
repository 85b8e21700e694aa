"""The Triton norm backward kernels (kernels/norm/triton_norm.py) at explicit tiles (ROWS, num_warps, programs,
PREFETCH, RELOAD), against the PyTorch reference (outputs and gradients, fp64 oracle) and ROWS > 1 against the
row-at-a-time tile: 7 rows, so the last tile of a program is partial and some programs end early; ngroups 2 and 3,
strided x / z / dout rows, fp32 and bf16, the staged modes (sumsq -> dot -> apply), the add kernel with and
without dres_in and with dres written in its own dtype or not. Triton's CPU interpreter in CI; the GPU at these
shapes where there is one. The end-to-end norm tests (autograd, the custom ops) are in test_kernels_triton.py."""
import pytest
import torch

# kernel_cases sets TRITON_INTERPRET before the Triton kernels are first imported
from kernel_cases import DEV, F64, TRITON_WARNINGS, needs_triton, rel
from kernel_cases import triton_mode  # noqa: F401  (fixture)
from megassm.kernels.norm import reference as norm_ref

pytestmark = TRITON_WARNINGS

M, D = 7, 24
# (ROWS, num_warps, programs[, PREFETCH[, RELOAD]]); BASE is the row-at-a-time tile the others are held to
BASE = (1, 1, 3)
TILES = [None, (2, 2, 3), (4, 4, 2), (1, 2, 7, 1, 0), (2, 1, 2, 0, 1), (4, 2, 1, 1, 1), (2, 4, 5, 1, 1)]


def _close(got, want, dtype, tol32=1e-5):
    for u, v in zip(got, want):
        if v is None:
            assert u is None
            continue
        assert u.dtype == v.dtype and u.shape == v.shape
        assert rel(u, v) < (tol32 if u.dtype == torch.float32 else 1e-2), (rel(u, v), u.dtype)


def _same(got, base):
    """ROWS > 1 against ROWS = 1: the same per-row math (dx, dz, dres); dweight only summed in another order."""
    for u, v in zip(got, base):
        if v is not None:
            assert rel(u, v) < (1e-6 if u.dtype == torch.float32 else 1e-3)


def _gated_inputs(G, dtype, gate, weight, seed):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(1, M, 3 * D + 5, generator=g).to(DEV, dtype)
    x = wide[..., 3:3 + D] if seed % 2 else torch.randn(1, M, D, generator=g).to(DEV, dtype)
    z = wide[..., D + 4:2 * D + 4] if gate else None  # strided rows, as Mamba-2's z in in_proj's output
    do = wide[..., 2 * D + 5:] if not seed % 2 else torch.randn(1, M, D, generator=g).to(DEV, dtype)
    w = torch.randn(D, generator=g).to(DEV) if weight else None
    return x, z, w, do


def _gated_oracle(x, z, w, do, G, nbg):
    leaves = [t.detach().to(F64).requires_grad_(True) for t in (x, z, w) if t is not None]
    it = iter(leaves)
    xx, zz, ww = next(it), (next(it) if z is not None else None), (next(it) if w is not None else None)
    out = norm_ref.gated_rmsnorm(xx, zz, ww, ngroups=G, norm_before_gate=nbg)
    grads = iter(torch.autograd.grad(out, leaves, do.to(F64)))
    dx, dz, dw = next(grads), (next(grads) if z is not None else None), (next(grads) if w is not None else None)
    return out.to(x.dtype), dx.to(x.dtype), None if dz is None else dz.to(z.dtype), None if dw is None else dw.float()


GATED_CASES = [  # (ngroups, dtype, norm_before_gate, z, weight)
    (2, torch.float32, False, True, True), (3, torch.bfloat16, False, True, True),
    (2, torch.bfloat16, True, True, True), (3, torch.float32, True, True, False),
    (2, torch.float32, False, False, True), (1, torch.bfloat16, False, False, True),
]


@needs_triton
@pytest.mark.parametrize("G,dtype,nbg,gate,weight", GATED_CASES)
def test_gated_rmsnorm_bwd_tiles(triton_mode, G, dtype, nbg, gate, weight):
    from megassm.kernels.norm import triton_norm as tn

    x, z, w, do = _gated_inputs(G, dtype, gate, weight, seed=G + 2 * int(nbg))
    out, *want = _gated_oracle(x, z, w, do, G, nbg)
    _close([tn.gated_rmsnorm_fwd(x, z, w, G, 1e-5, nbg)], [out], dtype)
    base = tn._gated_bwd(do, x, z, w, G, 1e-5, nbg, 0, tiles=BASE)
    _close(base, want, dtype)
    for tiles in TILES:
        got = tn._gated_bwd(do, x, z, w, G, 1e-5, nbg, 0, tiles=tiles)
        _close(got, want, dtype)
        _same(got, base)


@needs_triton
@pytest.mark.parametrize("G,dtype,nbg", [(2, torch.float32, False), (3, torch.bfloat16, True)])
def test_gated_rmsnorm_staged_bwd_tiles(triton_mode, G, dtype, nbg):
    """MODE 1 (dot) and MODE 2 (gradients from the given sumsq and dot), one device holding the whole groups:
    the reference stages, and MODE 0, at every tile."""
    from megassm.kernels.norm import triton_norm as tn

    x, z, w, do = _gated_inputs(G, dtype, True, True, seed=5)
    dg = D // G
    ss = norm_ref.gated_rmsnorm_sumsq(x, z, G, nbg).float()
    dot_ref = norm_ref.gated_rmsnorm_bwd_dot(do.to(F64), x.to(F64), z.to(F64), w.to(F64), ss.to(F64), dg, 1e-5, nbg)
    want = _gated_oracle(x, z, w, do, G, nbg)[1:]
    base = tn._gated_bwd(do, x, z, w, G, 1e-5, nbg, 0, tiles=BASE)
    for tiles in [BASE] + TILES:
        dot = tn._gated_bwd(do, x, z, w, G, 1e-5, nbg, 1, ss, None, dg, tiles=tiles)
        assert dot.shape == (1, M, G) and dot.dtype == torch.float32
        assert rel(dot, dot_ref) < 1e-5
        got = tn._gated_bwd(do, x, z, w, G, 1e-5, nbg, 2, ss, dot, dg, tiles=tiles)
        _close(got, want, dtype)
        _same(got, base)


@needs_triton
@pytest.mark.parametrize("mode", [0, 2])
def test_gated_rmsnorm_bwd_writes_dz_into_a_split_block(triton_mode, mode):
    """dz into z's column block of a split_last(share_grads=True) buffer (Mamba-2's in_proj gradient; MODE 2 is
    the TP plan whose norm groups span ranks): the same bits as a fresh dz, written through the block's row
    stride, and the block is what comes back."""
    from megassm import kernels as K
    from megassm.kernels import grad_blocks
    from megassm.kernels.norm import triton_norm as tn

    G, dtype, nbg = 2, torch.bfloat16, False
    x, z, w, do = _gated_inputs(G, dtype, True, True, seed=7)
    dg = D // G
    wide = torch.cat([z, torch.randn(*z.shape[:-1], 40, device=DEV).to(dtype)], -1).requires_grad_(True)
    zp, _ = K.split_last(wide, [D, 40], share_grads=True)
    ss = norm_ref.gated_rmsnorm_sumsq(x, z, G, nbg).float()
    dot = tn._gated_bwd(do, x, z, w, G, 1e-5, nbg, 1, ss, None, dg) if mode == 2 else None
    args = (ss, dot, dg) if mode == 2 else ()
    want = tn._gated_bwd(do, x, z, w, G, 1e-5, nbg, mode, *args)
    block = grad_blocks.grad_block(zp)
    got = tn._gated_bwd(do, x, zp, w, G, 1e-5, nbg, mode, *args, out_dz=block)
    assert got[1] is block and block.stride()[-2] == D + 40
    for u, v in zip(got, want):
        assert torch.equal(u, v)


ADD_CASES = [  # (dres_in, x dtype, residual dtype): dres written in fp32 besides dx, or dres = dx, or none
    (True, torch.bfloat16, torch.float32), (False, torch.bfloat16, torch.float32),
    (True, torch.float32, torch.float32), (False, torch.bfloat16, None),
]


@needs_triton
@pytest.mark.parametrize("has_dres,x_dtype,res_dtype", ADD_CASES)
def test_add_rmsnorm_bwd_tiles(triton_mode, has_dres, x_dtype, res_dtype):
    from megassm.kernels.norm import triton_norm as tn

    g = torch.Generator().manual_seed(int(has_dres) + 2 * (res_dtype is None))
    x = torch.randn(1, M, D, generator=g).to(DEV, x_dtype)
    res = torch.randn(1, M, D, generator=g).to(DEV, res_dtype) if res_dtype is not None else None
    w = torch.randn(D, generator=g).to(DEV)
    do = torch.randn(1, M, D, generator=g).to(DEV, x_dtype)
    dres_in = torch.randn(1, M, D, generator=g).to(DEV) if has_dres else None
    leaves = [t.to(F64).requires_grad_(True) for t in (x, w) + ((res,) if res is not None else ())]
    o64, nr64 = norm_ref.add_rmsnorm(leaves[0], leaves[2] if res is not None else None, leaves[1])
    loss = (o64 * do.to(F64)).sum() + ((nr64 * dres_in.to(F64)).sum() if has_dres else 0.0)
    gx, gw, *gr = torch.autograd.grad(loss, leaves)
    want = [gx.to(x_dtype), gr[0].to(res_dtype) if res is not None else None, gw.float()]
    out, newres = tn.add_rmsnorm_fwd(x, res, w, 1e-5)
    _close([out, newres], [o64.to(x_dtype), nr64.float()], x_dtype)
    base = tn.add_rmsnorm_bwd(do, dres_in, newres, w, 1e-5, x_dtype, res_dtype, tiles=BASE)
    _close(base, want, x_dtype)
    for tiles in TILES:
        got = tn.add_rmsnorm_bwd(do, dres_in, newres, w, 1e-5, x_dtype, res_dtype, tiles=tiles)
        _close(got, want, x_dtype)
        _same(got, base)


@needs_triton
def test_norm_bwd_tiles_refuse_non_power_of_two_rows(triton_mode):
    from megassm.kernels.norm import triton_norm as tn

    x = torch.randn(M, D).to(DEV)
    with pytest.raises(ValueError, match="powers of 2"):
        tn.add_rmsnorm_bwd(x, None, x, None, 1e-5, x.dtype, None, tiles=(3, 1, 2))
