"""train.cast_weights_once (training/weight_cache.py): the Linears compute with bf16 copies of their weights,
cast once per step, and hooks add the copies' bf16 gradients into the fp32 weights' gradients. The claim is
exact equality with bf16 autocast's own per-use casts: the same losses, gradients and weights bit for bit, in
one process (CPU, bf16 autocast), over TP 2 + SP (gloo), and on the GPU (`-m gpu`: under CUDA graphs too)."""
import copy

import pytest
import torch

from megassm.config import ConfigError, ModelConfig, MambaConfig, MLPConfig, AttentionConfig, load_config
from megassm.models import build_model
from megassm.training.checks import check_supported
from megassm.training.trainer import Trainer
from megassm.training.weight_cache import CachedLinear, WeightCache

TINY = [
    "data.builtin=stdlib",
    "model.pattern=M*M-",
    "model.d_model=64",
    "model.mamba.d_state=16",
    "model.mamba.headdim=16",
    "model.mamba.chunk_size=16",
    "model.mlp.ffn_hidden=96",
    "train.seq_len=48",
    "train.micro_batch=2",
    "train.global_batch=6",  # three accumulated micro-batches per step
    "train.steps=3",
    "train.log_interval=1",
    "train.eval_interval=2",
    "train.eval_tokens=96",
    "train.precision=bf16",
    "optim.warmup_steps=1",
    "optim.lr=3e-3",
    "run.progress=false",
    "run.save_interval=0",
    "run.save_final=false",
]


def _model():
    cfg = ModelConfig(pattern="M*-M-", d_model=32, vocab_size=97, tie_embeddings=False,
                      mamba=MambaConfig(d_state=8, headdim=8, chunk_size=8),
                      attn=AttentionConfig(n_heads=4, n_kv_heads=2), mlp=MLPConfig(ffn_hidden=48))
    torch.manual_seed(0)
    m = build_model(cfg, vocab_size=97)
    m.init_weights(seed=0)
    return m


def _micro_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (2, 24), generator=g) for _ in range(n)]


def _step(model, batches, opt):
    losses = []
    for tok in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(tok[:, :-1], labels=tok[:, 1:])
        (out.loss / len(batches)).backward()
        losses.append(out.loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    opt.zero_grad(set_to_none=True)
    return losses, grads


def test_copies_give_autocast_bit_for_bit():
    """Two optimizer steps of three micro-batches: losses, every gradient and the weights after each step equal
    to plain bf16 autocast, exactly."""
    ref = _model()
    ours = copy.deepcopy(ref)
    cache = WeightCache(ours)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in ref.modules())
    assert len(cache.pairs) == n_linear > 0
    assert all(type(m) is CachedLinear for n, m in ours.named_modules() if isinstance(m, torch.nn.Linear))
    assert ours.state_dict().keys() == ref.state_dict().keys()  # the copies are no parameters or buffers
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    for step in range(2):
        batches = _micro_batches(3, seed=step)
        cache.refresh()
        lr, gr = _step(ref, batches, opt_r)
        lo, go = _step(ours, batches, opt_o)
        assert all(torch.equal(a, b) for a, b in zip(lr, lo)), (lr, lo)
        assert gr.keys() == go.keys()
        bad = [n for n in gr if not torch.equal(gr[n], go[n])]
        assert not bad, bad
        assert all(c.grad is None for _, c in cache.pairs)  # handed over to the fp32 gradients
        for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
            assert torch.equal(p, q), n


def test_stale_copies_would_differ():
    """The refresh matters: without it the second step computes with the first step's weights."""
    ref = _model()
    ours = copy.deepcopy(ref)
    WeightCache(ours)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    _step(ref, _micro_batches(1), opt_r)
    _step(ours, _micro_batches(1), opt_o)
    lr, _ = _step(ref, _micro_batches(1, seed=5), opt_r)
    lo, _ = _step(ours, _micro_batches(1, seed=5), opt_o)  # no refresh
    assert not torch.equal(lr[0], lo[0])


def _fit(run_dir, *extra):
    tr = Trainer(load_config(None, TINY + [f"run.dir={run_dir}", *extra]))
    try:
        losses = tr.fit()
        return losses, {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    finally:
        tr.close()


def test_trainer_equal_to_autocast(tmp_path):
    """The trainer's loop (refresh before each step and before evaluation) on CPU in bf16: the same losses and
    final weights as without the copies."""
    la, wa = _fit(tmp_path / "a")
    lb, wb = _fit(tmp_path / "b", "train.cast_weights_once=true")
    assert la == lb
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_tensor_parallel_equal_to_autocast(tmp_path):
    """TP 2 + SP over gloo (column-parallel CachedLinears, the row-parallel Linears reading their copies): the
    same losses as without the copies, bit for bit."""
    from multiproc import losses, train_records

    base = [a for a in TINY if not a.startswith("train.eval")] + ["train.eval_interval=0"]
    plain = losses(train_records(tmp_path / "a", 2, ["parallel.tp=2", "parallel.sp=true"], base=base))
    cached = losses(train_records(tmp_path / "b", 2, ["parallel.tp=2", "parallel.sp=true",
                                                      "train.cast_weights_once=true"], base=base))
    assert sorted(plain) == [1, 2, 3] and plain == cached, (plain, cached)


@pytest.mark.parametrize("world, extra, match", [
    (1, ["train.precision=fp32"], r"train.precision=fp32 on cpu: the weights are cast for bf16 autocast"),
    (2, ["parallel.world_size=2", "train.global_batch=8", "parallel.engine=fsdp2"],
     r"parallel.engine=fsdp2: FSDP2 and DeepSpeed keep bf16"),
    (2, ["parallel.world_size=2", "parallel.pp=2", "model.pattern=M-M-"], r"parallel.pp=2: not built for pipeline"),
    (1, ["train.bptt=true"], r"train.bptt=true"),
    (2, ["parallel.world_size=2", "train.global_batch=8"],
     r"2 data-parallel ranks without train.cuda_graph: torch DDP's hooks"),
])
def test_refusals_name_the_reason(monkeypatch, world, extra, match):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = load_config(None, TINY + ["train.cast_weights_once=true", *extra])
    with pytest.raises(ConfigError, match=r"train.cast_weights_once=true: " + match):
        check_supported(cfg)


@pytest.mark.parametrize("world, extra", [
    (2, ["parallel.tp=2", "parallel.sp=true"]),
    (2, ["parallel.world_size=2", "train.global_batch=8", "train.cuda_graph=true"]),
    (4, ["parallel.tp=2", "parallel.zero_stage=1", "train.global_batch=8", "train.cuda_graph=true"]),
])
def test_takes_tp_and_dp_under_graphs(monkeypatch, world, extra):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        monkeypatch.delenv(name, raising=False)
    check_supported(load_config(None, TINY + ["train.cast_weights_once=true", f"parallel.world_size={world}",
                                              *extra]))


def _gpu_fit(run_dir, *extra):
    tr = Trainer(load_config(None, [a for a in TINY if a != "train.precision=bf16"]
                             + ["train.precision=bf16", "train.device=cuda", f"run.dir={run_dir}", *extra]))
    try:
        return tr.fit()
    finally:
        tr.close()


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_gpu_equal_to_autocast(tmp_path, graph):
    """One GPU, the Triton kernels, eager and under CUDA graphs (the copies' hooks captured in the graphs, the
    refresh eager before the replays): the losses of the same run without the copies, within the CUDA-graph
    tests' eager-vs-graph bound (two GPU runs need not be bitwise equal: cuBLAS may pick algorithms by the
    operands' alignment)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    extra = ["train.cuda_graph=true"] if graph else []
    plain = _gpu_fit(tmp_path / "a", *extra)
    cached = _gpu_fit(tmp_path / "b", *extra, "train.cast_weights_once=true")
    assert len(plain) == len(cached) == 3
    torch.testing.assert_close(torch.tensor(cached), torch.tensor(plain), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_tp_dp_under_graphs_equal_to_autocast(tmp_path):
    """4 GPUs, TP 2 x ZeRO-1 DP 2 under CUDA graphs (the 7B layout's shape): the losses of the same run without
    the copies."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
        pytest.skip("fewer than 4 CUDA GPUs")
    from multiproc import losses, train_records

    base = [a for a in TINY if not a.startswith(("train.eval", "train.global_batch"))]
    base += ["train.eval_interval=0", "train.global_batch=8", "parallel.tp=2", "parallel.zero_stage=1",
             "train.cuda_graph=true"]
    plain = losses(train_records(tmp_path / "a", 4, base=base))
    cached = losses(train_records(tmp_path / "b", 4, ["train.cast_weights_once=true"], base=base))
    assert sorted(plain) == sorted(cached) == [1, 2, 3], (plain, cached)
    torch.testing.assert_close(torch.tensor([cached[s] for s in (1, 2, 3)]),
                               torch.tensor([plain[s] for s in (1, 2, 3)]), rtol=1e-5, atol=1e-6)
