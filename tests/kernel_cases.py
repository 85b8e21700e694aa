"""Shared pieces of the kernel tests (test_kernels_triton.py, test_kernels_ssd.py, test_seed_scan.py): the
interpreter setup, which must precede the first import of the Triton kernels, the backend fixtures, the SSD
input builders, and the error criteria.

Criteria: fp32 inputs: relative error vs a fp64 oracle well under 1e-4. bf16 inputs: at most 2x the
reference's own bf16 error (reference run on the same bf16 inputs vs the fp64 oracle); under the interpreter
3x, because Triton 3.6's interpreter truncates fp32 -> bf16 conversions instead of rounding to nearest (which
alone doubles the output rounding error). fp32 outputs of bf16 inputs (final states, their gradient) carry a
floor of 1e-4: the kernels' state products run as bf16 hi+lo pairs (~16 mantissa bits).
"""
import os

import pytest
import torch


HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the Triton kernels
# correctness runs need no autotuning (one config per kernel: far fewer compilations on the device)
os.environ.setdefault("MEGASSM_TRITON_AUTOTUNE", "0")

try:
    import triton  # noqa: F401

    HAS_TRITON, TRITON_ERR = True, ""
except Exception as e:  # pragma: no cover - depends on the environment
    HAS_TRITON, TRITON_ERR = False, repr(e)

import megassm.kernels as K  # noqa: E402
from megassm.kernels import dispatch  # noqa: E402
from megassm.kernels.mamba2_ssd import op as ssd_ops  # noqa: E402

# each test module sets `pytestmark = TRITON_WARNINGS`
TRITON_WARNINGS = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.*"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.*"),
]

F64 = torch.float64
DEV = "cuda" if HAS_CUDA else "cpu"
INTERP = not HAS_CUDA
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason=f"triton is not importable: {TRITON_ERR}")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def triton_mode(monkeypatch):
    """MEGASSM_KERNELS=triton for one test; on CPU the kernels must have been decorated in interpreter mode."""
    if not HAS_TRITON:
        pytest.skip(f"triton is not importable: {TRITON_ERR}")
    monkeypatch.setenv("MEGASSM_KERNELS", "triton")
    if not dispatch.triton_available():
        pytest.skip(f"the Triton kernels failed to import: {dispatch.triton_error()!r}")
    if not HAS_CUDA:
        from megassm.kernels.mamba2_ssd import triton_ssd_common

        if not triton_ssd_common._INTERPRET:
            pytest.skip("the Triton kernels were imported before TRITON_INTERPRET=1 was set")
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def torch_mode(monkeypatch):
    monkeypatch.setenv("MEGASSM_KERNELS", "torch")


# --------------------------------------------------------------------------------------------------------
# input builders


def seq_from_starts(starts_per_row, seqlen, device=DEV):
    rows = []
    for r, starts in enumerate(starts_per_row):
        row = torch.zeros(seqlen, dtype=torch.int32)
        for s in starts:
            if 0 < s < seqlen:
                row[s:] += 1
        rows.append(row + 3 * r)
    return torch.stack(rows).to(device)


def reset_starts(seqlen, chunk, bsz):
    """Resets exercising the edge cases: a document of length 1, a reset exactly on a chunk edge, a reset on
    the last token; row 1 has a different layout (and row 0 of a batch of 1 gets all of them)."""
    a = [chunk, chunk + 1, seqlen // 2 + 3, seqlen - 1]
    b = [1, 2 * chunk, seqlen - 5]
    return [a, b][:bsz] if bsz > 1 else [a]


def ssd_inputs(bsz, seqlen, nheads, hdim, ngroups, dstate, *, init=True, d_mode="head", gate=True, bias=True,
               seed=0, device=DEV, dt_scale=1.0, a_scale=1.0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    inp = dict(
        x=rnd(bsz, seqlen, nheads, hdim),
        dt=rnd(bsz, seqlen, nheads, scale=dt_scale),
        A=-(torch.rand(nheads, generator=g) * 2 * a_scale + 0.1).to(device),
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


LOWP_KEYS = ("x", "dt", "B", "C", "z")  # activations; parameters and states stay fp32


def cast_inputs(inp, lowp=None, to=None):
    out = {}
    for k, v in inp.items():
        if to is not None:
            out[k] = v.to(to)
        elif lowp is not None and k in LOWP_KEYS:
            out[k] = v.to(lowp)
        else:
            out[k] = v
    return out


def run_ssd(fn, inp, seq_idx=None, seed=1, grad_via=None, final=True, **kw):
    """Outputs and every gradient of sum(y*gy) + sum(final*gf), as a dict name -> tensor. grad_via: gy rounded
    through that dtype first (an fp64 oracle then takes the bf16 run's own output gradient). final=False: the
    call without final states (y and the gradients of sum(y*gy) only)."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inp.items()}
    y, fin = fn(**leaves, seq_idx=seq_idx, return_final_states=True, **kw) if final else \
        (fn(**leaves, seq_idx=seq_idx, **kw), None)
    g = torch.Generator().manual_seed(seed)
    outs = {"y": (y, torch.randn(y.shape, generator=g).to(grad_via or y.dtype).to(y.device, y.dtype))}
    if fin is not None:
        outs["final"] = (fin, torch.randn(fin.shape, generator=g).to(fin.device, fin.dtype))
    grads = torch.autograd.grad([o for o, _ in outs.values()], list(leaves.values()), [go for _, go in outs.values()])
    out = {k: o.detach() for k, (o, _) in outs.items()}
    out.update({"d" + k: gr for k, gr in zip(leaves, grads)})
    return out


def check_fp32(ours, oracle, tol):
    bad = {k: rel(ours[k], oracle[k]) for k in oracle if not rel(ours[k], oracle[k]) < tol}
    assert not bad, f"relative errors over {tol}: {bad}"
    for k, v in ours.items():
        assert torch.isfinite(v).all(), k


def check_lowp(ours, ref, oracle, factor, fp32_floor=1e-4):
    """bf16 errors within factor x the reference's; fp32 outputs (states) may add fp32_floor (see above)."""
    bad = {}
    for k in oracle:
        e_ref, e_ours = rel(ref[k], oracle[k]), rel(ours[k], oracle[k])
        floor = fp32_floor if ours[k].dtype == torch.float32 else 2e-5
        if not e_ours <= factor * e_ref + floor:
            bad[k] = (e_ours, e_ref)
    assert not bad, f"(ours, reference) bf16 errors beyond {factor}x: {bad}"


def op_ssd(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=None, initial_states=None,
            seq_idx=None, chunk_size=256, return_final_states=False):
    """kernels.ssd through the custom op (as under torch.compile)."""
    y, fin, _ = ssd_ops.ssd_op(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx,
                               chunk_size, return_final_states)
    return (y, fin) if return_final_states else y
