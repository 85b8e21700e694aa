"""The custom-op plumbing of megassm.kernels (torch path, fake tensors, env switch, logging, compile) and the
Triton norm, SwiGLU and decode-step kernels against the PyTorch references (outputs and every gradient), plus a
tiny model on the Triton kernels. The SSD kernels have their own file, test_kernels_ssd.py, and the conv its own,
test_kernels_conv.py; the shared setup and criteria are in kernel_cases.py.

Default run (CI, CPU): the plumbing, then the Triton kernels in Triton's CPU interpreter at tiny shapes;
skipped with the reason when triton cannot be imported. On a machine with CUDA the same tiny tests run on the
GPU; `pytest -m gpu tests/test_kernels_triton.py` adds the conv and norms at real shapes.
"""
import logging

import pytest
import torch

# kernel_cases sets TRITON_INTERPRET before the Triton kernels are first imported
from kernel_cases import (
    DEV, F64, INTERP, K, TRITON_WARNINGS, cast_inputs, gpu, needs_cuda, needs_triton, op_ssd, rel,
    reset_starts, run_ssd, seq_from_starts, ssd_inputs,
)
from kernel_cases import triton_mode, torch_mode  # noqa: F401  (fixtures)
from megassm.kernels import dispatch
from megassm.kernels.act import op as act_ops
from megassm.kernels.act import reference as act_ref
from megassm.kernels.conv1d import op as conv_ops
from megassm.kernels.conv1d import reference as conv_ref
from megassm.kernels.loss import op as loss_ops
from megassm.kernels.norm import op as norm_ops
from megassm.kernels.norm import reference as norm_ref
from megassm.kernels.mamba2_ssd import op as ssd_ops
from megassm.kernels.mamba2_ssd import reference as ssd_ref

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
        b = run_ssd(ssd_ref.ssd, inp, sid, chunk_size=4, dt_limit=(0.0, 2.0))
        for k in b:
            assert torch.equal(a[k], b[k]), k

    x = torch.randn(2, 9, 6, dtype=F64, requires_grad=True)
    w = torch.randn(6, 4, dtype=F64, requires_grad=True)
    bb = torch.randn(6, dtype=F64, requires_grad=True)
    st = torch.randn(2, 6, 3, dtype=F64, requires_grad=True)
    sid = seq_from_starts([[3], [1]], 9, device="cpu")
    outs = []
    for fn in (lambda *a: conv_ops.causal_conv1d_op(*a, sid, "silu", True), lambda *a: conv_ref.causal_conv1d(
            *a, seq_idx=sid, return_final_state=True)):
        y, f = fn(x, w, bb, st)
        outs.append((y, f) + torch.autograd.grad((y * 1.7).sum() + (f * 0.3).sum(), (x, w, bb, st)))
    assert all(torch.equal(u, v) for u, v in zip(*outs))

    x = torch.randn(3, 8, dtype=F64, requires_grad=True)
    z = torch.randn(3, 8, dtype=F64, requires_grad=True)
    w = torch.randn(8, dtype=F64, requires_grad=True)
    ga = torch.autograd.grad(norm_ops.gated_rmsnorm_op(x, z, w, 2, 1e-5, False).pow(2).sum(), (x, z, w))
    gb = torch.autograd.grad(norm_ref.gated_rmsnorm(x, z, w, ngroups=2).pow(2).sum(), (x, z, w))
    assert all(torch.equal(u, v) for u, v in zip(ga, gb))
    r = torch.randn(3, 8, dtype=F64, requires_grad=True)
    oa, ra = norm_ops.add_rmsnorm_op(x, r, w, 1e-5)
    ob, rb = norm_ref.add_rmsnorm(x, r, w)
    ga = torch.autograd.grad(oa.pow(2).sum() + ra.sum(), (x, r, w))
    gb = torch.autograd.grad(ob.pow(2).sum() + rb.sum(), (x, r, w))
    assert torch.equal(oa, ob) and torch.equal(ra, rb) and all(torch.equal(u, v) for u, v in zip(ga, gb))


def test_outputs_never_alias_inputs(torch_mode):
    x = torch.randn(2, 4)
    out, res = norm_ops.add_rmsnorm_op(x, None, None, 1e-5)
    assert res.data_ptr() != x.data_ptr()
    torch.testing.assert_close(res, x)


def test_opcheck_custom_ops(torch_mode):
    inp = ssd_inputs(1, 6, 2, 2, 1, 3, d_mode="head", device="cpu")
    sid = seq_from_starts([[2]], 6, device="cpu")
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["dt_bias"], True,
            (0.0, 5.0), inp["initial_states"], sid, 4, True)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(ssd_ops.ssd_op, args, test_utils=tests)
    x = torch.randn(2, 5, 3)
    torch.library.opcheck(conv_ops.causal_conv1d_op, (x, torch.randn(3, 4), torch.randn(3), torch.randn(2, 3, 3),
                                                 None, "silu", True), test_utils=tests)
    torch.library.opcheck(norm_ops.gated_rmsnorm_op, (x, torch.randn(2, 5, 3), torch.randn(3), 1, 1e-5, False),
                          test_utils=tests)
    torch.library.opcheck(norm_ops.rmsnorm_op, (x, torch.randn(3), 1e-5), test_utils=tests)
    torch.library.opcheck(norm_ops.rmsnorm_op, (x, torch.randn(3), 1e-5, torch.bfloat16), test_utils=tests)
    torch.library.opcheck(norm_ops.add_rmsnorm_op, (x, torch.randn(2, 5, 3), torch.randn(3), 1e-5), test_utils=tests)
    torch.library.opcheck(act_ops.swiglu_op, (x, torch.randn(2, 5, 3)), test_utils=tests)
    torch.library.opcheck(loss_ops.cross_entropy_op, (torch.randn(4, 7), torch.tensor([1, -100, 6, 0]), -100),
                          test_utils=tests)
    torch.library.opcheck(ssd_ops.ssd_step_op, (torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3), torch.randn(2, 2),
                                            -torch.rand(2), torch.randn(2, 1, 4), torch.randn(2, 1, 4), None,
                                            None, None, True, None), test_utils=tests)
    torch.library.opcheck(conv_ops.causal_conv1d_step_op, (torch.randn(2, 3, 3), torch.randn(2, 3), torch.randn(3, 4),
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
    assert not dispatch.use_triton(torch.randn(2))  # auto: CPU tensors use the reference
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
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("gate", [True, False])
def test_gated_rmsnorm_triton(triton_mode, norm_before_gate, gate):
    x = torch.randn(3, 5, 48).to(DEV)
    z = torch.randn(3, 5, 48).to(DEV) if gate else None
    w = torch.randn(48).to(DEV)
    outs = []
    for fn in (K.gated_rmsnorm, norm_ref.gated_rmsnorm):
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
    ref = norm_ref.gated_rmsnorm(leaves[0], leaves[2] if gate else None, leaves[1], ngroups=G,
                          norm_before_gate=norm_before_gate)
    want = (ref,) + torch.autograd.grad(ref, leaves, dout)

    def part(t, q):  # device q's channels of every group
        return None if t is None else t.unflatten(-1, (G, 2, h))[..., q, :].flatten(-2)

    def whole(ts):
        return torch.stack([t.unflatten(-1, (G, h)) for t in ts], -2).flatten(-3)

    for lib in (K, norm_ref):
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
    for lib in (K, norm_ref):
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
    o, o2 = K.rmsnorm(*xs), norm_ref.rmsnorm(*xr)
    ga, gb = torch.autograd.grad(o.pow(2).sum(), xs), torch.autograd.grad(o2.pow(2).sum(), xr)
    assert rel(o, o2) < 1e-5 and all(rel(u, v) < 1e-5 for u, v in zip(ga, gb))
    for res_dtype in (None, torch.float32):
        xb = x.bfloat16()
        r = torch.randn(4, 3, 40).to(DEV) if res_dtype else None
        outs = []
        for fn in (K.add_rmsnorm, norm_ref.add_rmsnorm):
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
def test_rmsnorm_of_the_sum_matches_the_fused_add(triton_mode):
    """Activation checkpointing's keep=sum (parallel/checkpointing.py): summed = residual + hidden (fp32), then
    rmsnorm(summed, out_dtype=bf16), against the fused add_rmsnorm(hidden, residual): the same normed output in
    bf16 (one rounding of the same fp32 values), and the same gradients of hidden, residual and weight given the
    normed output's and the residual stream's gradients. The reference path with out_dtype as well."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 40, generator=g).to(DEV, torch.bfloat16)
    residual = torch.randn(2, 5, 40, generator=g).to(DEV)
    w = torch.randn(40, generator=g).to(DEV)
    do = torch.randn(2, 5, 40, generator=g).to(DEV, torch.bfloat16)
    dres = torch.randn(2, 5, 40, generator=g).to(DEV)
    results = []
    for fused, lib in ((True, K), (False, K), (False, norm_ref)):
        h, r, ww = (t.clone().requires_grad_(True) for t in (hidden, residual, w))
        if fused:
            normed, summed = lib.add_rmsnorm(h, r, ww)
        else:
            summed = r + h
            normed = lib.rmsnorm(summed, ww, 1e-5, torch.bfloat16)
        assert normed.dtype == torch.bfloat16 and summed.dtype == torch.float32
        grads = torch.autograd.grad((normed.float() * do.float()).sum() + (summed * dres).sum(), (h, r, ww))
        results.append((normed, summed) + grads)
    for other in results[1:]:
        torch.testing.assert_close(other[1], results[0][1], rtol=0, atol=0)  # the same fp32 add
        assert (other[0].float() - results[0][0].float()).abs().max() <= 1e-2 * results[0][0].float().abs().max()
        for u, v in zip(other[2:], results[0][2:]):
            assert rel(u, v) < 1e-2
    assert K.rmsnorm(residual, w, 1e-5, torch.float32).dtype == torch.float32  # the input's dtype: the plain op


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
    ours, ref = _swiglu_grads(K.swiglu, a, b, dh), _swiglu_grads(act_ref.swiglu, a, b, dh)
    for u, v in zip(ours, ref):
        assert u.dtype == torch.float32 and rel(u, v) < 1e-6
    oracle = _swiglu_grads(act_ref.swiglu, a.double(), b.double(), dh.double())
    lo = [t.bfloat16() for t in (a, b, dh)]
    ours, ref = _swiglu_grads(K.swiglu, *lo), _swiglu_grads(act_ref.swiglu, *lo)
    factor = 2.0 if INTERP else 1.05
    for u, v, o in zip(ours, ref, oracle):
        assert u.dtype == torch.bfloat16 and rel(u, o) <= rel(v, o) * factor + 1e-6, (rel(u, o), rel(v, o))
    wide = torch.randn(shape[0], shape[1], 2 * shape[2], generator=g).to(DEV)
    sa, sb = wide[..., : shape[2]], wide[..., shape[2]:]  # strided halves
    ours, ref = _swiglu_grads(K.swiglu, sa, sb, dh), _swiglu_grads(act_ref.swiglu, sa, sb, dh)
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
    y2, new2 = ssd_ref.ssd_step(state, x, dt, A, Bm, Cm, **kw)
    assert rel(y, y2) < 1e-5 and rel(new, new2) < 1e-5 and new.dtype == torch.float32
    cs, xc, w, b = rn(bsz, 24, 3), rn(bsz, 24), rn(24, 4), rn(24)
    for act in ("silu", None):
        yc, nc = K.causal_conv1d_step(cs, xc.bfloat16(), w, b, activation=act)
        yc2, nc2 = conv_ref.causal_conv1d_step(cs, xc.bfloat16(), w, b, activation=act)
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
    for fn in (K.causal_conv1d, conv_ref.causal_conv1d):
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
    for fn in (K.gated_rmsnorm, norm_ref.gated_rmsnorm):
        lv = [t.clone().requires_grad_(True) for t in (xn, zn, wn)]
        o = fn(lv[0], lv[1], lv[2], ngroups=8)
        res.append((o,) + torch.autograd.grad(o.float().pow(2).sum(), lv))
    for u, v in zip(*res):
        assert rel(u, v) < tol
    r = torch.randn(bsz, seqlen, d, device="cuda")
    res = []
    for fn in (K.add_rmsnorm, norm_ref.add_rmsnorm):
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
    oracle = _swiglu_grads(act_ref.swiglu, a.double(), b.double(), dh.double())
    lo = [t.bfloat16() for t in (a, b, dh)]
    ours, ref = _swiglu_grads(K.swiglu, *lo), _swiglu_grads(act_ref.swiglu, *lo)
    for u, v, o in zip(ours, ref, oracle):
        assert rel(u, o) <= rel(v, o) * 1.05 + 1e-6, (rel(u, o), rel(v, o))
