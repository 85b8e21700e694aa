"""The selective scan of the seed mixers `S` (Mamba-1, decay="exp") and `L` (Longhorn, decay="longhorn"):
the chunked PyTorch reference and the Triton kernels against the token-by-token oracle
(reference.selective_scan_sequential), outputs and every gradient (initial state included, with a gradient
on the final state), document resets (a one-token document among them), odd lengths and sizes.

CPU default run: the reference and the custom-op plumbing, then the Triton kernels in Triton's interpreter
(TRITON_INTERPRET=1, set before the kernels are decorated) at tiny shapes. `pytest -m gpu
tests/test_seed_scan.py` runs the grid at real shapes on the device. Criteria as in kernel_cases.py:
fp32 relative error < 1e-5 against an fp64 oracle; bf16 inputs within 2x the reference's own bf16 error
(3x under the interpreter, which truncates fp32 -> bf16 instead of rounding).
"""
import pytest
import torch

# kernel_cases sets TRITON_INTERPRET before the Triton kernels are first imported
from kernel_cases import (
    DEV, F64, INTERP, TRITON_WARNINGS, K, gpu, needs_cuda, needs_triton, rel, seq_from_starts,
)
from kernel_cases import check_fp32 as check
from kernel_cases import check_lowp as _check_lowp
from kernel_cases import triton_mode, torch_mode  # noqa: F401  (fixtures)
from megassm.kernels.coffee import op as coffee_ops
from megassm.kernels.coffee import reference as coffee_ref
from megassm.kernels.scan import op as scan_ops
from megassm.kernels.scan import reference as scan_ref

pytestmark = TRITON_WARNINGS


def check_lowp(ours, ref, oracle, factor):
    """kernel_cases' criterion with a tighter fp32 floor: the scan keeps its states in fp32 throughout."""
    _check_lowp(ours, ref, oracle, factor, fp32_floor=1e-5)


def reset_starts(seqlen, bsz, T=16):
    """A one-token document (starts s and s+1), a reset on a chunk edge of the kernels (T), one on the last
    token; row 1: a reset at t = 1 and another layout."""
    a = [3, 4, T, seqlen // 2 + 1, seqlen - 1]
    b = [1, T + 5, seqlen - 3]
    return [a, b][:bsz]


def scan_inputs(bsz, seqlen, d, n, groups=1, decay="exp", *, init=True, D=True, gate=True, bias=True, seed=0,
                device=DEV, dt_scale=1.0):
    """Random inputs; for "longhorn" delta is a real eps = beta / (1 + beta |k|^2) (gate in (0, 1])."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    bc_shape = (bsz, seqlen, n) if groups == 1 else (bsz, seqlen, groups, n)
    inp = dict(x=rnd(bsz, seqlen, d), B=rnd(*bc_shape), C=rnd(*bc_shape))
    if decay == "exp":
        inp["delta"] = rnd(bsz, seqlen, d, scale=dt_scale)
        inp["A"] = -(torch.rand(d, n, generator=g) * 2 + 0.1)
        if bias:
            inp["delta_bias"] = rnd(d, scale=0.5)
    else:
        beta = torch.sigmoid(rnd(bsz, seqlen, d))
        k2 = inp["B"].pow(2).sum(-1)
        k2 = k2[..., None] if groups == 1 else k2.repeat_interleave(d // groups, dim=-1)
        inp["delta"] = beta / (1 + beta * k2)
    if D:
        inp["D"] = rnd(d)
    if gate:
        inp["z"] = rnd(bsz, seqlen, d)
    if init:
        inp["initial_state"] = rnd(bsz, d, n)
    return {k: v.to(device) for k, v in inp.items()}


LOWP_KEYS = ("x", "delta", "B", "C", "z")  # activations; parameters and states stay fp32


def cast(inp, lowp=None, to=None):
    return {k: (v.to(to) if to is not None else (v.to(lowp) if lowp is not None and k in LOWP_KEYS else v))
            for k, v in inp.items()}


def run_scan(fn, inp, decay, seq_idx=None, seed=1, **kw):
    """Outputs and every gradient of sum(y*gy) + sum(final*gf), as a dict name -> tensor."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inp.items()}
    A = leaves.pop("A", None)
    args = dict(leaves)
    y, fin = fn(args.pop("x"), args.pop("delta"), A, args.pop("B"), args.pop("C"), **args,
                delta_softplus=decay == "exp", decay=decay, seq_idx=seq_idx, return_final_state=True, **kw)
    g = torch.Generator().manual_seed(seed)
    gy = torch.randn(y.shape, generator=g).to(y.device, y.dtype)
    gf = torch.randn(fin.shape, generator=g).to(fin.device, fin.dtype)
    wrt = dict(leaves)
    if A is not None:
        wrt["A"] = A
    grads = torch.autograd.grad((y, fin), list(wrt.values()), (gy, gf))
    out = {"y": y.detach(), "final": fin.detach()}
    out.update({"d" + k: gr for k, gr in zip(wrt, grads)})
    return out


# --------------------------------------------------------------------------------------------------------
# reference: chunked vs the sequential oracle (fp64: agreement to rounding)


@pytest.mark.parametrize("decay", ["exp", "longhorn"])
@pytest.mark.parametrize("groups,chunk", [(1, 8), (2, 5), (1, 64)])
def test_reference_chunked_matches_sequential(decay, groups, chunk):
    bsz, seqlen, d, n = 2, 37, 6, 5
    inp = cast(scan_inputs(bsz, seqlen, d, n, groups, decay, device="cpu"), to=F64)
    sid = seq_from_starts(reset_starts(seqlen, bsz, T=chunk), seqlen, device="cpu")
    a = run_scan(scan_ref.selective_scan, inp, decay, sid, chunk_size=chunk)
    b = run_scan(scan_ref.selective_scan_sequential, inp, decay, sid)
    check(a, b, 1e-12)


def test_reference_semantics():
    """Resets cut the state (a row with a reset == its documents run apart; the initial state reaches only the
    first), the final state is the last document's, one token and zero-length edge cases."""
    decay = "exp"
    inp = cast(scan_inputs(1, 12, 4, 3, device="cpu"), to=F64)
    sid = seq_from_starts([[5]], 12, device="cpu")
    y, fin = scan_ref.selective_scan(inp["x"], inp["delta"], inp["A"], inp["B"], inp["C"], D=inp["D"], z=inp["z"],
                              delta_bias=inp["delta_bias"], delta_softplus=True, initial_state=inp["initial_state"],
                              seq_idx=sid, return_final_state=True)
    parts = []
    for lo, hi, h0 in ((0, 5, inp["initial_state"]), (5, 12, None)):
        parts.append(scan_ref.selective_scan_sequential(
            inp["x"][:, lo:hi], inp["delta"][:, lo:hi], inp["A"], inp["B"][:, lo:hi], inp["C"][:, lo:hi], D=inp["D"],
            z=inp["z"][:, lo:hi], delta_bias=inp["delta_bias"], delta_softplus=True, decay=decay, initial_state=h0,
            return_final_state=True))
    torch.testing.assert_close(y, torch.cat([parts[0][0], parts[1][0]], 1))
    torch.testing.assert_close(fin, parts[1][1])
    # L = 1 and the step agree with the chunked form
    one = {k: (v[:, :1] if v.dim() >= 3 and v.shape[1] == 12 else v) for k, v in inp.items()}
    y1, f1 = scan_ref.selective_scan(one["x"], one["delta"], one["A"], one["B"], one["C"], D=one["D"], z=one["z"],
                              delta_bias=one["delta_bias"], delta_softplus=True, initial_state=one["initial_state"],
                              return_final_state=True)
    ys, fs = scan_ref.selective_scan_step(one["initial_state"], one["x"][:, 0], one["delta"][:, 0], one["A"],
                                   one["B"][:, 0], one["C"][:, 0], D=one["D"], z=one["z"][:, 0],
                                   delta_bias=one["delta_bias"], delta_softplus=True)
    torch.testing.assert_close(y1[:, 0], ys)
    torch.testing.assert_close(f1, fs)
    y0, f0 = scan_ref.selective_scan(inp["x"][:, :0], inp["delta"][:, :0], inp["A"], inp["B"][:, :0], inp["C"][:, :0],
                              initial_state=inp["initial_state"], return_final_state=True)
    assert y0.shape == (1, 0, 4) and torch.equal(f0, inp["initial_state"])


def test_longhorn_gate_and_eps():
    """Longhorn eq. 7 on the scan: with eps = beta / (1 + beta |k|^2) every gate 1 - eps k_j^2 lies in
    [1 / (1 + beta |k|^2), 1], so the state stays bounded even for large keys."""
    from megassm.models.longhorn import longhorn_eps

    g = torch.Generator().manual_seed(0)
    logits, k = torch.randn(3, 50, 8, generator=g, dtype=F64), 10 * torch.randn(3, 50, 4, generator=g, dtype=F64)
    eps = longhorn_eps(logits, k)
    beta = torch.sigmoid(logits)
    k2 = k.pow(2).sum(-1, keepdim=True)
    gate = 1 - eps[..., None] * k[..., None, :] ** 2
    assert (gate <= 1).all() and (gate >= (1 / (1 + beta * k2))[..., None] - 1e-12).all()
    x = torch.randn(3, 50, 8, generator=g, dtype=F64)
    y, fin = scan_ref.selective_scan_sequential(x, eps, None, k, k, decay="longhorn", return_final_state=True)
    assert torch.isfinite(y).all() and fin.abs().max() < 10 * x.abs().max()


def test_bad_arguments_are_named():
    inp = scan_inputs(1, 4, 4, 3, device="cpu")
    with pytest.raises(ValueError, match="decay must be one of"):
        K.selective_scan(inp["x"], inp["delta"], inp["A"], inp["B"], inp["C"], decay="bogus")
    with pytest.raises(ValueError, match="decay='longhorn' has no A"):
        K.selective_scan(inp["x"], inp["delta"], inp["A"], inp["B"], inp["C"], decay="longhorn")
    with pytest.raises(ValueError, match=r"needs A \[D=4, N=3\]"):
        K.selective_scan(inp["x"], inp["delta"], inp["A"][:, :2], inp["B"], inp["C"])
    with pytest.raises(ValueError, match="groups"):
        K.selective_scan(inp["x"], inp["delta"], inp["A"], inp["B"].view(1, 4, 1, 3).expand(1, 4, 3, 3),
                         inp["C"].view(1, 4, 1, 3).expand(1, 4, 3, 3))


# --------------------------------------------------------------------------------------------------------
# custom-op plumbing (no triton needed)


def _op_scan(x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, decay="exp",
             initial_state=None, seq_idx=None, return_final_state=False):
    y, fin = scan_ops.selective_scan_op(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay, initial_state,
                                   seq_idx, return_final_state)
    return (y, fin) if return_final_state else y


@pytest.mark.parametrize("decay", ["exp", "longhorn"])
def test_reference_through_op_is_the_reference(torch_mode, decay):
    inp = cast(scan_inputs(2, 13, 4, 3, decay=decay, device="cpu"), to=F64)
    sid = seq_from_starts([[4, 5], [8]], 13, device="cpu")
    b = run_scan(scan_ref.selective_scan, inp, decay, sid)
    for fn in (_op_scan, K.selective_scan):
        a = run_scan(fn, inp, decay, sid)
        for k in b:
            assert torch.equal(a[k], b[k]), k


def test_opcheck_and_compile(torch_mode):
    inp = scan_inputs(1, 6, 4, 3, device="cpu")
    sid = seq_from_starts([[2]], 6, device="cpu")
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    args = (inp["x"], inp["delta"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["delta_bias"], True, "exp",
            inp["initial_state"], sid, True)
    torch.library.opcheck(scan_ops.selective_scan_op, args, test_utils=tests)
    lh = scan_inputs(1, 6, 4, 3, groups=2, decay="longhorn", init=False, gate=False, device="cpu")
    torch.library.opcheck(scan_ops.selective_scan_op, (lh["x"], lh["delta"], None, lh["B"], lh["C"], lh["D"], None, None,
                                                  False, "longhorn", None, None, False), test_utils=tests)
    torch.library.opcheck(scan_ops.selective_scan_step_op, (torch.randn(2, 4, 3), torch.randn(2, 4), torch.randn(2, 4),
                                                       -torch.rand(4, 3), torch.randn(2, 3), torch.randn(2, 3),
                                                       torch.randn(4), torch.randn(2, 4), None, True, "exp"),
                          test_utils=tests)

    g = torch.Generator().manual_seed(0)
    cof = (torch.randn(2, 6, 4, generator=g), -torch.rand(4, 3, generator=g), torch.randn(4, 3, generator=g),
           torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g), torch.randn(2, 4, 3, generator=g), sid.expand(2, 6))
    torch.library.opcheck(coffee_ops.coffee_scan_op, cof, test_utils=tests)

    def f(x, delta, A, B, C):
        return K.selective_scan(x, delta, A, B, C, delta_softplus=True)

    a = (inp["x"], inp["delta"], inp["A"], inp["B"], inp["C"])
    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True)(*a), f(*a))


# --------------------------------------------------------------------------------------------------------
# Triton kernels at tiny shapes (interpreter on CPU, native on a GPU)

TINY = {
    # name: (bsz, seqlen, d, n, groups, decay, scan_inputs kwargs, resets)
    "exp_all": (2, 37, 6, 5, 1, "exp", {}, True),
    "exp_groups": (2, 21, 8, 4, 2, "exp", {}, True),
    "exp_bare": (1, 16, 4, 16, 1, "exp", dict(init=False, D=False, gate=False, bias=False), False),
    "exp_one_token": (2, 1, 5, 3, 1, "exp", {}, False),
    "longhorn_all": (2, 37, 6, 5, 1, "longhorn", {}, True),
    "longhorn_groups_nogate": (2, 19, 6, 7, 3, "longhorn", dict(gate=False), True),
}


@needs_triton
@pytest.mark.parametrize("case", list(TINY))
def test_triton_fp32_vs_sequential_oracle(triton_mode, case):
    bsz, seqlen, d, n, groups, decay, mk, resets = TINY[case]
    inp = scan_inputs(bsz, seqlen, d, n, groups, decay, **mk)
    sid = seq_from_starts(reset_starts(seqlen, bsz), seqlen) if resets else None
    ours = run_scan(K.selective_scan, inp, decay, sid)
    oracle = run_scan(scan_ref.selective_scan_sequential, cast(inp, to=F64), decay, sid)
    check(ours, oracle, 1e-5)


@needs_triton
@pytest.mark.parametrize("decay", ["exp", "longhorn"])
def test_triton_backward_channel_loop_and_partials(triton_mode, decay):
    """The backward's layout knobs: several channel blocks per program (B/C gradient partials accumulated in a
    program-owned buffer), a block that runs past the channels, chunks shorter than the default."""
    from megassm.kernels.scan import triton_scan as tk

    inp = scan_inputs(2, 23, 10, 5, 1, decay)
    sid = seq_from_starts(reset_starts(23, 2, T=8), 23)
    oracle = run_scan(scan_ref.selective_scan_sequential, cast(inp, to=F64), decay, sid)
    g = torch.Generator().manual_seed(1)
    gy = torch.randn(oracle["y"].shape, generator=g).to(DEV)
    gf = torch.randn(oracle["final"].shape, generator=g).to(DEV)
    A = inp.get("A")
    args = (inp["x"], inp["delta"], A, inp["B"], inp["C"], inp["D"], inp["z"], inp.get("delta_bias"), decay == "exp",
            decay, inp["initial_state"], sid)
    for tiles in ((4, 8, 4, 2), (2, 4, 2, 3)):
        grads = tk.selective_scan_bwd(gy, gf, *args, tiles=tiles)
        names = ("dx", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias", "dinitial_state")
        for name, gr in zip(names, grads):
            if name in oracle:
                assert rel(gr, oracle[name]) < 1e-5, (tiles, name, rel(gr, oracle[name]))
        y, fin = tk.selective_scan_fwd(*args, True, tiles=tiles[:3])
        assert rel(y, oracle["y"]) < 1e-5 and rel(fin, oracle["final"]) < 1e-5


@needs_triton
@pytest.mark.parametrize("decay", ["exp", "longhorn"])
def test_triton_bf16_within_reference_error(triton_mode, decay):
    bsz, seqlen = 2, 40
    inp = scan_inputs(bsz, seqlen, 8, 16, 1, decay)
    low = cast(inp, lowp=torch.bfloat16)
    sid = seq_from_starts(reset_starts(seqlen, bsz), seqlen)
    ours = run_scan(K.selective_scan, low, decay, sid)
    ref = run_scan(scan_ref.selective_scan, low, decay, sid)
    oracle = run_scan(scan_ref.selective_scan_sequential, cast(low, to=F64), decay, sid)
    assert ours["y"].dtype == torch.bfloat16 and ours["final"].dtype == torch.float32
    check_lowp(ours, ref, oracle, 3.0 if INTERP else 2.0)


@needs_triton
def test_triton_deterministic_and_finite_at_extremes(triton_mode):
    # softplus(delta) up to ~10, A down to -2: decays underflow to exactly 0; nothing may blow up
    inp = scan_inputs(1, 48, 8, 16, dt_scale=6.0)
    inp["delta_bias"] = torch.full_like(inp["delta_bias"], 4.0)
    a = run_scan(K.selective_scan, inp, "exp")
    b = run_scan(K.selective_scan, inp, "exp")
    for k in a:
        assert torch.isfinite(a[k]).all(), k
        assert torch.equal(a[k], b[k]), k


@needs_triton
@pytest.mark.parametrize("decay,groups", [("exp", 1), ("longhorn", 2)])
def test_triton_step_matches_reference(triton_mode, decay, groups):
    inp = scan_inputs(3, 1, 12, 5, groups, decay)
    one = {k: (v[:, 0] if k in ("x", "delta", "z", "B", "C") else v) for k, v in inp.items()}
    kw = dict(D=one["D"], z=one["z"], delta_bias=one.get("delta_bias"), delta_softplus=decay == "exp", decay=decay)
    y, s = K.selective_scan_step(one["initial_state"], one["x"], one["delta"], one.get("A"), one["B"], one["C"], **kw)
    y_ref, s_ref = scan_ref.selective_scan_step(one["initial_state"].double(), one["x"].double(), one["delta"].double(),
                                         None if one.get("A") is None else one["A"].double(), one["B"].double(),
                                         one["C"].double(), **{k: (v.double() if torch.is_tensor(v) else v)
                                                                for k, v in kw.items()})
    assert rel(y, y_ref) < 1e-6 and rel(s, s_ref) < 1e-6 and s.dtype == torch.float32


# --------------------------------------------------------------------------------------------------------
# GPU: real shapes (pytest -m gpu)

# (bsz, seqlen, d_inner, N, groups, decay, initial states, resets)
GPU_GRID = [
    (2, 1, 1536, 16, 1, "exp", True, False),
    (2, 63, 1536, 16, 1, "exp", True, True),
    (2, 1000, 2048, 16, 1, "exp", True, True),
    (1, 4097, 1536, 16, 1, "exp", True, True),
    (2, 2048, 2048, 16, 1, "exp", False, True),
    (2, 1000, 1024, 64, 4, "exp", True, True),
    (2, 63, 1536, 16, 1, "longhorn", True, True),
    (2, 2048, 2048, 16, 1, "longhorn", True, True),
    (1, 4097, 1536, 16, 1, "longhorn", False, True),
    (1, 16384, 512, 16, 1, "longhorn", True, True),
    # one chunk (the backward's scratch states are stored and read back at once: a missing barrier read stale
    # memory here), and 8 channel blocks per backward program (partials accumulated across blocks)
    (2, 2, 1536, 16, 1, "longhorn", True, False),
    (2, 31, 1536, 16, 1, "exp", True, True),
    (8, 40, 4096, 16, 1, "exp", True, False),
]


def _gpu_case(case, seed=0):
    bsz, seqlen, d, n, groups, decay, init, resets = case
    inp = scan_inputs(bsz, seqlen, d, n, groups, decay, init=init, seed=seed, device="cuda")
    sid = seq_from_starts(reset_starts(seqlen, bsz), seqlen, device="cuda") if resets else None
    return inp, sid, decay


@gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_GRID, ids=lambda c: "{5}-B{0}-L{1}-D{2}-N{3}-G{4}".format(*c))
def test_gpu_scan_fp32(triton_mode, case):
    inp, sid, decay = _gpu_case(case)
    ours = run_scan(K.selective_scan, inp, decay, sid)
    oracle = run_scan(scan_ref.selective_scan, cast(inp, to=F64), decay, sid)
    check(ours, oracle, 1e-5 if case[1] <= 2048 else 5e-5)  # fp32 rounding accumulates along long sequences
    if case[1] <= 1000:  # the chunked reference itself vs the token-by-token recurrence
        check(ours, run_scan(scan_ref.selective_scan_sequential, cast(inp, to=F64), decay, sid), 1e-5)


@gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_GRID, ids=lambda c: "{5}-B{0}-L{1}-D{2}-N{3}-G{4}".format(*c))
def test_gpu_scan_bf16(triton_mode, case):
    inp, sid, decay = _gpu_case(case, seed=1)
    low = cast(inp, lowp=torch.bfloat16)
    ours = run_scan(K.selective_scan, low, decay, sid)
    ref = run_scan(scan_ref.selective_scan, low, decay, sid)
    oracle = run_scan(scan_ref.selective_scan, cast(low, to=F64), decay, sid)
    check_lowp(ours, ref, oracle, 2.0)


@gpu
@needs_cuda
def test_gpu_scan_deterministic_16k(triton_mode):
    inp = scan_inputs(2, 16384, 2048, 16, dt_scale=6.0, device="cuda")
    low = cast(inp, lowp=torch.bfloat16)
    a = run_scan(K.selective_scan, low, "exp")
    b = run_scan(K.selective_scan, low, "exp")
    for k in a:
        assert torch.isfinite(a[k]).all(), k
        assert torch.equal(a[k], b[k]), k  # no atomics: bitwise identical run to run


# --------------------------------------------------------------------------------------------------------
# COFFEE (`C`, solver=sequential): the fused recurrence + read-out kernel against the reference loop


def _coffee_case(bsz, seqlen, dim, n, *, of, x0, resets, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(DEV)  # noqa: E731
    args = dict(v=r(bsz, seqlen, dim).to(dtype), lam=-torch.rand(dim, n, generator=g).to(DEV) * 1.9,
                w=r(dim, n), C=r(dim, n), w_out=r(dim, n) if of else None, x0=r(bsz, dim, n) if x0 else None)
    sid = None
    if resets:  # a one-token document, and a reset on a segment edge (K = 8 under the interpreter test)
        sid = torch.zeros(bsz, seqlen, dtype=torch.int32)
        sid[0, seqlen // 2:] = 1
        sid[0, seqlen // 2 + 1:] = 2
        sid[-1, 16:] = 1
        sid = sid.to(DEV)
    return args, sid


def _coffee_check(args, sid, tol, gtol):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in args.items() if v is not None}
    y, fin = K.coffee_scan(leaves["v"], leaves["lam"], leaves["w"], leaves["C"], leaves.get("w_out"),
                           leaves.get("x0"), sid)
    assert y.dtype == torch.float32 and fin.dtype == torch.float32
    f64 = {k: v.detach().double().requires_grad_(True) for k, v in args.items() if v is not None}
    yr, finr = coffee_ref.coffee_scan(f64["v"], f64["lam"], f64["w"], f64["C"], f64.get("w_out"), f64.get("x0"), sid)
    assert rel(y, yr) < tol and rel(fin, finr) < tol
    gy, gf = torch.randn_like(y), torch.randn_like(fin)
    ours = torch.autograd.grad((y * gy).sum() + (fin * gf).sum(), list(leaves.values()))
    ref = torch.autograd.grad((yr * gy.double()).sum() + (finr * gf.double()).sum(), list(f64.values()))
    for name, a, b in zip(leaves, ours, ref):
        assert a.dtype == leaves[name].dtype, name
        tol_n = 1e-2 if a.dtype == torch.bfloat16 else gtol  # dv is returned in v's dtype: one bf16 rounding
        assert rel(a, b) < tol_n, (name, rel(a, b))


@needs_triton
@pytest.mark.parametrize("of,x0,resets,n", [(True, True, True, 3), (False, False, False, 4)])
def test_triton_coffee_scan_matches_reference(triton_mode, monkeypatch, of, x0, resets, n):
    """Several checkpoint segments (K = 8) and a partial last one; resets at a segment edge and a one-token
    document; the output filter; a state size that is not a power of two (padded lanes)."""
    from megassm.kernels.coffee import triton_coffee

    monkeypatch.setattr(triton_coffee, "SEGMENT", 8)
    args, sid = _coffee_case(2, 37, 5, n, of=of, x0=x0, resets=resets)
    _coffee_check(args, sid, 1e-5, 1e-5)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_coffee_scan(triton_mode, dtype):
    """Real shapes (L 2048, 512 channels, n 16, both filters' variants) on the GPU; bf16 inputs (the in_proj
    output under autocast) give fp32 states, so the same bound holds against the fp64 loop on those inputs."""
    for of, resets in ((True, True), (False, False)):
        args, sid = _coffee_case(2, 2048, 512, 16, of=of, x0=True, resets=resets, dtype=dtype)
        args["w"] = args["w"] * 0.3
        _coffee_check(args, sid, 1e-4, 1e-4)
