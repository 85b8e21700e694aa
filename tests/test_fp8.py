"""train.fp8 (training/fp8.py) and kernels.fp8_linear (kernels/fp8/op.py): the projections' three matmuls in FP8 with
per-tensor power-of-two scales. The op is checked against a plain fp32 autograd emulation of the same
quantization (outputs and gradients, odd token counts, bias, bf16 and fp32 inputs), and against the exact
linear within FP8's rounding; the module swap keeps every name and weight; the trainer trains with it (CPU bf16
autocast: torch._scaled_mm has a CPU implementation); `-m gpu` runs the op at a 1.3B layer's shape on the GPU,
inside a CUDA graph too."""
import pytest
import torch
import torch.nn.functional as F

from megassm.config import ConfigError, ModelConfig, MambaConfig, MLPConfig, AttentionConfig, load_config
from megassm.kernels.fp8 import E4M3, E5M2, cast_fp8, fp8_linear, fp8_linear_reference, fp8_weight, to_fp8
from megassm.models import build_model
from megassm.training.checks import check_supported
from megassm.training.fp8 import FP8Linear, apply_fp8
from megassm.training.trainer import Trainer

from kernel_cases import DEV, gpu, rel, triton_mode  # noqa: F401  (fixture)

HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _run(fn, x, w, b, g):
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    b = None if b is None else b.detach().requires_grad_(True)
    y = fn(x, w, b)
    y.backward(g.to(y.dtype))
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 32, 64), (3, 13, 64)])  # 64 tokens, and 39 (dW through the fallback)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_equals_the_emulated_quantization(dtype, shape, bias):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    w = torch.randn(80, shape[-1]) * 0.02  # fp32 master weight, a projection's scale
    b = torch.randn(80) if bias else None
    g = (torch.randn(*shape[:-1], 80) * 1e-3).to(dtype)  # what autograd hands a bf16 output: both see its values
    y, dx, dw, db = _run(fp8_linear, x, w, b, g)
    yr, dxr, dwr, dbr = _run(fp8_linear_reference, x, w, b, g)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's and dx's own rounding
    assert rel(y, yr) < tol
    assert rel(dx, dxr) < tol
    assert rel(dw, dwr) < (1e-5 if shape[1] == 32 or dtype == torch.float32 else 8e-3)
    if bias:
        assert rel(db, dbr) < 1e-5


@pytest.mark.parametrize("mag", [1e-4, 1.0, 1e3])
def test_fp8_linear_is_near_the_exact_linear_at_any_magnitude(mag):
    """The scales follow the tensors: the relative error is FP8's (3 mantissa bits forward, 2 backward) whatever
    the magnitude."""
    torch.manual_seed(1)
    x, w, g = torch.randn(64, 96) * mag, torch.randn(48, 96) * mag, torch.randn(64, 48) * mag
    y, dx, dw, _ = _run(fp8_linear, x, w, None, g)
    ye, dxe, dwe, _ = _run(lambda a, b_, c: F.linear(a, b_), x, w, None, g)
    assert rel(y, ye) < 0.06
    assert rel(dx, dxe) < 0.12 and rel(dw, dwe) < 0.12


def test_to_fp8_scales_are_powers_of_two_and_never_saturate():
    t = torch.tensor([0.0, 1e-3, -2.5, 447.9 / 1024, 3.0e4])
    for dt in (E4M3, E5M2):
        t8, inv = to_fp8(t, dt)
        assert torch.log2(inv) == torch.round(torch.log2(inv))
        assert t8.float().abs().max() <= torch.finfo(dt).max
        assert torch.isfinite(t8.float()).all()
    tiny = torch.full((4, 16), 1e-4, dtype=torch.float16)  # its scale (2^21) overflows fp16 itself
    t8, inv = to_fp8(tiny, E4M3)
    assert torch.allclose(t8.float() * inv, tiny.float(), rtol=0.07)
    z8, _ = to_fp8(torch.zeros(4, 16), E4M3)
    assert (z8.float() == 0).all()
    y, dx, dw, _ = _run(fp8_linear, torch.zeros(16, 32), torch.zeros(16, 32), None, torch.zeros(16, 16))
    assert (y == 0).all() and (dx == 0).all() and (dw == 0).all()
    y, dx, dw, db = _run(fp8_linear, torch.zeros(2, 0, 32), torch.ones(16, 32), torch.ones(16), torch.zeros(2, 0, 16))
    assert y.shape == (2, 0, 16) and dx.shape == (2, 0, 32) and (dw == 0).all() and (db == 0).all()


def _fp8_grid(shape, dtype, gen):
    """Random finite FP8 values (every bit pattern but NaN/inf) as fp32: inputs whose scaled copy is exact in FP8,
    so a cast must reproduce them bit for bit under any rounding (Triton's CPU interpreter rounds FP8 casts
    wrongly at ties and carries: the rounding itself is checked on the GPU below)."""
    v = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype).float()
    v[~torch.isfinite(v)] = 0.0
    return v


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.usefixtures("triton_mode")
def test_triton_cast_transpose_matches_the_eager_cast(dtype, src):
    """kernels/fp8/triton_fp8.py against to_fp8: the scale, both layouts, odd sizes (tile and amax-partial edges),
    strided input, in-place output, a zero tensor."""
    gen = torch.Generator().manual_seed(0)
    for M, K in [(77, 50), (1030, 24), (9, 300)]:
        t = (_fp8_grid((M, K), dtype, gen) * 2.0 ** -9).to(src).to(DEV)
        for x in (t, t.t()):  # contiguous and strided
            q, qt, inv = cast_fp8(x, dtype)
            r, rinv = to_fp8(x, dtype)
            assert torch.equal(inv, rinv)
            assert torch.equal(q.view(torch.uint8), r.view(torch.uint8))
            assert torch.equal(qt.view(torch.uint8), r.t().contiguous().view(torch.uint8))
    q, qt, inv = cast_fp8(t, dtype, transpose=False)
    assert qt is None and torch.equal(q.view(torch.uint8), to_fp8(t, dtype)[0].view(torch.uint8))
    q, qt, inv = cast_fp8(t, dtype, rowmajor=False)  # the backward's W^T alone
    assert q is None and torch.equal(qt.view(torch.uint8), to_fp8(t, dtype)[0].t().contiguous().view(torch.uint8))
    w = (_fp8_grid((48, 32), E4M3, gen) / 64).to(DEV)
    out = (torch.empty(48, 32, dtype=E4M3, device=DEV), torch.empty(32, 48, dtype=E4M3, device=DEV),
           torch.empty((), device=DEV))
    got = fp8_weight(w, out=out)
    assert all(a is b for a, b in zip(got, out))
    ref = to_fp8(w, E4M3)
    assert torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(out[2], ref[1])
    assert torch.equal(out[1].view(torch.uint8), ref[0].t().contiguous().view(torch.uint8))
    q, qt, inv = cast_fp8(torch.zeros(20, 32, dtype=src, device=DEV), dtype)
    assert (q.float() == 0).all() and torch.equal(inv, to_fp8(torch.zeros(1), dtype)[1].to(DEV))


def test_per_call_weight_cast_keeps_no_fp8_weight_for_the_backward():
    """Without the per-step cache (FSDP2's case) the forward keeps the weight itself, not an FP8 copy of it (that
    would hold a byte per parameter of the whole model until the backward), and the backward's W^T cast gives the
    gradients of the cached path bit for bit."""
    torch.manual_seed(0)
    x, w, g = torch.randn(64, 48), torch.randn(32, 48) * 0.1, torch.randn(64, 32)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        per_call = _run(fp8_linear, x, w, None, g)
    assert (torch.float32, (32, 48)) in saved  # the weight
    assert not [s for s in saved if s[0] in (E4M3, E5M2) and sorted(s[1]) == [32, 48]]
    cached = _run(lambda a, b, c: fp8_linear(a, b, c, fp8_weight(b.detach())), x, w, None, g)
    for u, v in zip(per_call[:3], cached[:3]):
        assert torch.equal(u, v)


def test_fp8_linear_refuses_sizes_scaled_mm_cannot_take():
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear(torch.randn(4, 24), torch.randn(16, 24))


def _model():
    cfg = ModelConfig(pattern="M*-M-", d_model=64, vocab_size=97, tie_embeddings=False,
                      mamba=MambaConfig(d_state=8, headdim=16, chunk_size=8),
                      attn=AttentionConfig(n_heads=4, n_kv_heads=2), mlp=MLPConfig(ffn_hidden=96))
    torch.manual_seed(0)
    m = build_model(cfg, vocab_size=97)
    m.init_weights(seed=0)
    return m


def test_apply_fp8_swaps_the_eligible_linears_and_keeps_the_rest():
    m = _model()
    names = dict(m.named_parameters())
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    tok = torch.randint(0, 97, (2, 33), generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = m(tok[:, :-1], labels=tok[:, 1:]).loss
    ref.backward()
    gref = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)

    out = apply_fp8(m)
    assert "lm_head" in out["kept"] and "head" in out["kept"]["lm_head"]
    in_proj = [k for k in out["kept"] if k.endswith("mixer.in_proj")]  # 64 -> 2*128 + 2*8 + 8 = 280 columns
    assert in_proj and all("multiples of 16" in out["kept"][k] for k in in_proj)
    assert any(n.endswith("out_proj") for n in out["fp8"]) and any(n.endswith("mixer.w2") for n in out["fp8"])
    for n in out["fp8"]:
        assert type(m.get_submodule(n)) is FP8Linear
    assert dict(m.named_parameters()).keys() == names.keys()  # the same names, the same tensors
    assert all(m.get_parameter(k) is p for k, p in names.items())
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(tok[:, :-1], labels=tok[:, 1:]).loss
    loss.backward()
    assert abs(loss.item() - ref.item()) < 0.02 * ref.item()
    for k, g in gref.items():
        assert rel(m.get_parameter(k).grad, g) < 0.2, k


def test_weights_cast_once_per_step_are_the_per_call_cast():
    """FP8WeightCache: the same outputs and gradients, bit for bit, as casting the weights at every call, as long
    as it is refreshed after the weights change (without the refresh the old weights' operands are used)."""
    from megassm.training.fp8 import FP8WeightCache

    tok = torch.randint(0, 97, (2, 33), generator=torch.Generator().manual_seed(4))

    def loss_grads(m):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(tok[:, :-1], labels=tok[:, 1:]).loss
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}

    per_call, cached = _model(), _model()
    apply_fp8(per_call)
    apply_fp8(cached)
    cache = FP8WeightCache(cached)
    la, ga = loss_grads(per_call)
    lb, gb = loss_grads(cached)
    assert torch.equal(la, lb) and all(torch.equal(ga[k], gb[k]) for k in ga)
    with torch.no_grad():  # an optimizer step's worth of change
        for a, b in zip(per_call.parameters(), cached.parameters()):
            a.mul_(1.05)
            b.mul_(1.05)
    stale, _ = loss_grads(cached)
    assert not torch.equal(stale, loss_grads(per_call)[0])
    cache.refresh()
    assert torch.equal(loss_grads(cached)[0], loss_grads(per_call)[0])


TINY = ["data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=64", "model.mamba.d_state=16",
        "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.mlp.ffn_hidden=96", "train.seq_len=48",
        "train.micro_batch=2", "train.global_batch=4", "train.steps=4", "train.log_interval=1",
        "train.eval_interval=0", "train.precision=bf16", "optim.warmup_steps=1", "optim.lr=3e-3",
        "run.progress=false", "run.save_interval=0", "run.save_final=false", "run.tensorboard=false"]


def _losses(tmp_path, name, *over):
    tr = Trainer(load_config(None, [*TINY, f"run.dir={tmp_path / name}", *over]))
    try:
        n = sum(isinstance(mod, FP8Linear) for mod in tr.model.modules())
        assert (n > 0) == (type(tr.weight_cache).__name__ == "FP8WeightCache")  # one process: cast once per step
        return n, tr.fit()
    finally:
        tr.close()


def test_trainer_with_fp8_follows_bf16(tmp_path):
    n, fp8 = _losses(tmp_path, "fp8", "train.fp8=true")
    assert n > 0
    _, bf16 = _losses(tmp_path, "bf16")
    assert len(fp8) == len(bf16) == 4
    assert max(abs(a - b) for a, b in zip(fp8, bf16)) < 0.05, (fp8, bf16)
    assert fp8[-1] < fp8[0]


@pytest.mark.parametrize("over,why", [
    (["parallel.tp=2", "parallel.world_size=2", "parallel.tp_overlap=true"], "tp_overlap"),
    (["parallel.tp=2", "parallel.world_size=4", "parallel.engine=fsdp2", "train.global_batch=8"], "FSDP2 x TP"),
    (["train.cast_weights_once=true"], "pick one"),
    (["train.precision=fp32"], "bf16 autocast"),
    (["parallel.engine=deepspeed", "parallel.world_size=2", "train.global_batch=4"], "deepspeed"),
])
def test_fp8_refusals_name_the_reason(monkeypatch, over, why):
    world = next((o.split("=")[1] for o in over if o.startswith("parallel.world_size")), "1")
    monkeypatch.setenv("WORLD_SIZE", world)
    cfg = load_config(None, [*TINY, "train.fp8=true", *over], validate_config=False)
    with pytest.raises(ConfigError, match=f"train.fp8=true: .*{why}"):
        check_supported(cfg, device=torch.device("cpu"))


# --------------------------------------------------------------------------------------------------------
# GPU (pytest -m gpu): FP8 tensor cores


@gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a GPU with FP8 tensor cores (compute capability >= 8.9)")
def test_gpu_fp8_linear_real_shape_and_under_a_cuda_graph():
    torch.manual_seed(0)
    x = torch.randn(4, 2048, 2048, device="cuda", dtype=torch.bfloat16)  # a 1.3B in_proj: 2048 -> 8512
    w = torch.randn(8512, 2048, device="cuda") * 0.02
    g = torch.randn(4, 2048, 8512, device="cuda", dtype=torch.bfloat16) * 1e-3
    y, dx, dw, _ = _run(fp8_linear, x, w, None, g)
    yr, dxr, dwr, _ = _run(fp8_linear_reference, x, w, None, g)
    assert rel(y, yr) < 8e-3 and rel(dx, dxr) < 8e-3 and rel(dw, dwr) < 1e-3
    ye = F.linear(x.float(), w)
    assert rel(y, ye) < 0.06

    xs = x.detach().clone().requires_grad_(True)
    ws = w.detach().clone().requires_grad_(True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the graph, as the trainer does
        fp8_linear(xs, ws).backward(g)
    torch.cuda.current_stream().wait_stream(s)
    xs.grad = ws.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = fp8_linear(xs, ws)
        yg.backward(g)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y) and torch.equal(xs.grad, dx) and torch.equal(ws.grad, dw)


@gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a GPU with FP8 tensor cores (compute capability >= 8.9)")
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_gpu_triton_cast_is_the_eager_cast_bit_for_bit(dtype):
    """On the GPU the Triton cast rounds as torch's does (round to nearest even): any values, real shapes."""
    torch.manual_seed(0)
    for shape, src in [((8192, 2048), torch.bfloat16), ((8192, 8512), torch.bfloat16), ((2049, 4096), torch.float32),
                       ((333, 80), torch.float16)]:
        t = torch.randn(*shape, device="cuda", dtype=src) * 3
        q, qt, inv = cast_fp8(t, dtype)
        r, rinv = to_fp8(t, dtype)
        assert torch.equal(inv, rinv)
        assert torch.equal(q.view(torch.uint8), r.view(torch.uint8))
        assert torch.equal(qt.view(torch.uint8), r.t().contiguous().view(torch.uint8))
        assert torch.equal(cast_fp8(t, dtype, rowmajor=False)[1], qt)


def test_fp8_under_fsdp2_dp2_equals_one_process(tmp_path):
    """FSDP2 over 2 gloo ranks with train.fp8 (the projections quantized from FSDP2's bf16 weights, the gradients
    reduce-scattered) against one process with twice the accumulation. One process runs the plain engine, whose
    projections quantize the fp32 weights directly (FSDP2's are rounded to bf16 first): 1.4e-4 apart at step 1,
    ~1e-4-1e-3 after (FP8 against bf16 is ~5e-4 on this model), so the bound is loose: the composition trains and
    follows one process."""
    from multiproc import train_losses

    base = [o for o in TINY if not o.startswith(("train.global_batch", "train.steps"))]
    over = ["train.fp8=true", "parallel.engine=fsdp2", "train.global_batch=8", "train.steps=3", "train.device=cpu"]
    one = train_losses(tmp_path / "one", 1, over, base=base, timeout=300)
    two = train_losses(tmp_path / "two", 2, over, base=base, timeout=300)
    assert sorted(one) == sorted(two) == [1, 2, 3]
    assert all(abs(one[s] - two[s]) < 2e-3 * one[s] for s in one), (one, two)


@pytest.mark.parametrize("sp", [False, True])
def test_fp8_under_tensor_parallelism_follows_one_process(tmp_path, sp):
    """TP 2 (+ SP) over gloo with train.fp8: the column-parallel Linears' rows and the row-parallel Linears'
    columns in FP8 (FP8RowParallelLinear: the local product, then the reduction), cast once per step. Each rank
    scales its own shards, so the quantization is per shard: close to one process's FP8 run, not equal (as FP8
    is to bf16 here, ~5e-4)."""
    from multiproc import train_losses

    over = ["train.fp8=true", "train.device=cpu"]
    one = train_losses(tmp_path / "one", 1, over, base=TINY, timeout=300)
    tp = ["parallel.tp=2", f"parallel.sp={str(sp).lower()}"]
    two = train_losses(tmp_path / "tp", 2, [*over, *tp], base=TINY, timeout=300)
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    assert all(abs(one[s] - two[s]) < 5e-3 * one[s] for s in one), (one, two)


def test_apply_fp8_swaps_the_row_parallel_linears(monkeypatch):
    """Under TP the row-parallel projections become FP8RowParallelLinear (same parameters and group), the
    column-parallel ones (plain Linears of their rows) FP8Linear, and a TP variant with its own autograd path
    (the entry Linear of tp_overlap) is kept in bf16, named."""
    from torch import nn

    from megassm.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megassm.training.fp8 import FP8RowParallelLinear

    model = nn.Sequential(nn.Linear(32, 64), RowParallelLinear(64, 32, bias=False), ColumnParallelLinear(32, 48))
    model[1].tp_group, model[1].sp = "g", True
    w = model[1].weight
    out = apply_fp8(model)
    assert type(model[0]) is FP8Linear and type(model[1]) is FP8RowParallelLinear
    assert model[1].weight is w and model[1].tp_group == "g" and model[1].sp
    assert out["fp8"] == ["0", "1"] and "own autograd path" in out["kept"]["2"]
