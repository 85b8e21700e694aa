"""train.cuda_graph: the config refusals, and the capture-safe forward + backward of a hybrid reading no value
on the host (CPU); on the device (`-m gpu`), graph replays training exactly like the eager loop: losses and
final weights, with gradient accumulation, document resets and a resume, for Mamba-2 and hybrid patterns."""
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megassm.config import AttentionConfig, ConfigError, MambaConfig, MLPConfig, ModelConfig, load_config
from megassm.models import build_model
from megassm.training.trainer import Trainer, check_supported

TINY = [
    "data.builtin=stdlib",
    "model.d_model=64",
    "model.mamba.d_state=16",
    "model.mamba.headdim=16",
    "model.mamba.chunk_size=16",
    "model.mlp.ffn_hidden=128",
    "train.seq_len=80",  # not a multiple of the chunk; packed documents give resets inside rows
    "train.micro_batch=2",
    "train.global_batch=4",  # two accumulated micro-batches per step
    "train.log_interval=1",
    "train.eval_interval=3",
    "train.eval_batches=2",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "run.progress=false",
]


def _cfg(run_dir, *extra, pattern="M-M-"):
    return load_config(None, TINY + [f"model.pattern={pattern}", f"run.dir={run_dir}", *extra])


@pytest.mark.parametrize("extra, pattern, match", [
    ((), "MBM-", r"model.pattern='MBM-' has block\(s\) 'B': .*B'MOJO counts its memory groups"),
    ((), "M*C-", r"has block\(s\) 'C': .*COFFEE"),
    ((), "BC*-", r"has block\(s\) 'B', 'C'"),
    (("train.bptt=true",), "M-M-", "train.bptt"),
])
def test_cuda_graph_refuses_what_a_capture_cannot_hold(tmp_path, extra, pattern, match):
    cfg = _cfg(tmp_path, "train.cuda_graph=true", *extra, pattern=pattern)
    with pytest.raises(ConfigError, match="train.cuda_graph=true: .*" + match):
        check_supported(cfg)


@pytest.mark.parametrize("pattern, extra", [
    ("M*M-", ()),
    ("*-", ("model.attn.sliding_window=16", "model.attn.n_kv_heads=2")),
    ("M*M-", ("model.attn.doc_mask=false",)),
])
def test_cuda_graph_takes_attention(tmp_path, pattern, extra):
    """Hybrid patterns: attention builds its document mask on the device under the graph (models/lm.py
    capture_safe)."""
    check_supported(_cfg(tmp_path, "train.cuda_graph=true", *extra, pattern=pattern))


def test_cuda_graph_takes_the_hybrid_recipe(tmp_path):
    cfg = load_config("configs/hybrid-1.3b.yaml",
                      ["data.builtin=stdlib", f"run.dir={tmp_path}", "train.cuda_graph=true"])
    assert "*" in cfg.model.pattern
    check_supported(cfg)


def test_cuda_graph_takes_activation_checkpointing(tmp_path):
    """The recomputation runs inside the captured backward (checkpointing without RNG state: no dropout)."""
    check_supported(_cfg(tmp_path, "train.cuda_graph=true", "train.activation_checkpointing=true", pattern="M*M-"))


def test_cuda_graph_refuses_pipeline_parallelism_and_sharding_engines(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"train.cuda_graph=true: parallel.pp=2: the pipeline schedule"):
        check_supported(_cfg(tmp_path, "train.cuda_graph=true", "parallel.pp=2"))
    with pytest.raises(ConfigError, match=r"train.cuda_graph=true: parallel.engine=fsdp2"):
        check_supported(_cfg(tmp_path, "train.cuda_graph=true", "parallel.world_size=2", "parallel.engine=fsdp2"))
    check_supported(_cfg(tmp_path, "train.cuda_graph=true", "parallel.world_size=2"))  # DDP: all-reduce after replays


@pytest.mark.parametrize("world, extra", [
    (2, ("parallel.tp=2",)),
    (2, ("parallel.tp=2", "parallel.sp=true")),
    (4, ("parallel.tp=2",)),  # TP 2 x DP 2: the DP all-reduce after the replays, as at TP 1
    (4, ("parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=1")),
    (2, ("parallel.tp=2", "train.activation_checkpointing=true")),
])
@pytest.mark.parametrize("pattern", ["M-M-", "M*M-", "MSL-"])
def test_cuda_graph_takes_tensor_parallelism(tmp_path, monkeypatch, world, extra, pattern):
    """TP (+ SP, x DP with engine ddp): its collectives are captured in the graph (training/cuda_graph.py)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        monkeypatch.delenv(name, raising=False)
    check_supported(_cfg(tmp_path, "train.cuda_graph=true", *extra, pattern=pattern))


@pytest.mark.parametrize("world, extra", [
    (2, ("parallel.cp=2",)),
    (2, ("parallel.cp=2", "train.activation_checkpointing=true")),
    (4, ("parallel.tp=2", "parallel.cp=2", "parallel.sp=true")),
    (4, ("parallel.cp=2",)),  # CP 2 x DP 2
])
@pytest.mark.parametrize("pattern", ["M-M-", "M*M-"])
def test_cuda_graph_takes_context_parallelism(tmp_path, monkeypatch, world, extra, pattern):
    """CP (x TP, x DP): the halo / state / K/V exchanges and the loss's all-reduce are captured in the graph, the
    CP gradient sum runs after the replays (training/cuda_graph.py)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        monkeypatch.delenv(name, raising=False)
    check_supported(_cfg(tmp_path, "train.cuda_graph=true", *extra, pattern=pattern))


@pytest.mark.parametrize("world, extra, match", [
    (4, ("parallel.tp=2", "parallel.pp=2"), r"parallel.pp=2: the pipeline schedule"),
    (2, ("parallel.tp=2", "train.bptt=true"), r"train.bptt=true"),
    (2, ("parallel.cp=2", "train.bptt=true"), r"train.bptt=true"),
])
def test_cuda_graph_with_tensor_parallelism_keeps_the_other_refusals(tmp_path, monkeypatch, world, extra, match):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=r"train.cuda_graph=true: " + match):
        check_supported(_cfg(tmp_path, "train.cuda_graph=true", *extra))


def test_cuda_graph_refuses_fsdp2_with_tensor_parallelism(tmp_path, monkeypatch):
    """FSDP2 x TP is a built layout, but its backward hooks cannot be captured: the graph check refuses it."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"train.cuda_graph=true: parallel.engine=fsdp2: FSDP2 and DeepSpeed hook"):
        check_supported(_cfg(tmp_path, "train.cuda_graph=true", "parallel.tp=2", "parallel.engine=fsdp2"))


@pytest.mark.parametrize("name, value", [("TORCH_NCCL_BLOCKING_WAIT", "1"), ("NCCL_BLOCKING_WAIT", "true")])
def test_cuda_graph_with_tensor_parallelism_refuses_nccl_blocking_wait(tmp_path, monkeypatch, name, value):
    """A blocking wait makes each collective wait on the host: no capture can hold that. Without TP (no
    collective in the graph) it does not matter."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"train.cuda_graph=true: {name}={value} with parallel.tp=2"):
        check_supported(_cfg(tmp_path, "train.cuda_graph=true", "parallel.tp=2"))
    with pytest.raises(ConfigError, match=rf"train.cuda_graph=true: {name}={value} with parallel.cp=2"):
        check_supported(_cfg(tmp_path, "train.cuda_graph=true", "parallel.cp=2"))
    check_supported(_cfg(tmp_path, "train.cuda_graph=true", "parallel.world_size=2"))
    monkeypatch.setenv(name, "0")
    check_supported(_cfg(tmp_path, "train.cuda_graph=true", "parallel.tp=2"))


def test_graphs_with_collectives_are_released_before_the_process_groups(monkeypatch):
    """NCCL >= 2.26 waits in a communicator's destruction until no CUDA graph references it: destroy() releases
    the graphs that captured collectives first; a graph without collectives is not registered."""
    from megassm.parallel import state
    from megassm.training.cuda_graph import GraphedMicroBatch

    released = []
    with_tp = GraphedMicroBatch([], lambda batch: None, collectives=True)
    without = GraphedMicroBatch([], lambda batch: None)
    monkeypatch.setattr(with_tp, "release", lambda: released.append("tp"))
    monkeypatch.setattr(without, "release", lambda: released.append("plain"))
    state.destroy()  # no process group here: only the releases
    assert released == ["tp"]
    GraphedMicroBatch([], lambda batch: None, collectives=True).release()  # nothing captured: nothing to reset


def test_cuda_graph_needs_a_cuda_device_before_any_model_is_built(tmp_path):
    with pytest.raises(ConfigError, match="needs a CUDA device; this run uses cpu"):
        Trainer(_cfg(tmp_path, "train.cuda_graph=true", "train.device=cpu"))


# ----------------------------------------------------------------------------------------------------
# no host read in the capture-safe forward + backward (CPU): what a capture would refuse raises here
# ----------------------------------------------------------------------------------------------------
# aten ops that copy a value to the host (item, bool(t), int(t), ...) or size their output by the values
_SYNC_OPS = ("_local_scalar_dense", "is_nonzero", "nonzero", "nonzero_static", "unique", "_unique", "_unique2",
             "unique_consecutive", "unique_dim", "masked_select", "equal", "repeat_interleave")


class _NoHostReads(TorchDispatchMode):
    """Raises on an aten op that reads tensor values on the host; counts the ops it let through."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS and not (name == "repeat_interleave" and "output_size" in (kwargs or {})):
            raise AssertionError(f"host read in the capture-safe forward/backward: aten.{name}")
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _forbid_host_reads(monkeypatch):
    """The Python-level ways to a host read (some, like tolist, never reach the dispatcher for CPU tensors)."""
    def refuse(name):
        def f(*a, **k):
            raise AssertionError(f"host read in the capture-safe forward/backward: Tensor.{name}")
        return f

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))


def _tiny_hybrid(pattern="M*M-*-", window=0):
    cfg = ModelConfig(pattern=pattern, d_model=32, mamba=MambaConfig(d_state=8, headdim=8, chunk_size=4, ngroups=2),
                      attn=AttentionConfig(n_heads=4, n_kv_heads=2, sliding_window=window),
                      mlp=MLPConfig(ffn_hidden=48))
    model = build_model(cfg, vocab_size=61)
    model.init_weights(0)
    return model.train()


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("resets", [True, False])
def test_capture_safe_hybrid_reads_nothing_on_the_host(monkeypatch, window, resets):
    """A hybrid's forward + backward with capture_safe set, batches with and without document resets (also a
    document starting at the last token): no op that syncs the device with the host. Without capture_safe the
    same model reads the single-document hint on the host (the check is live)."""
    tok = torch.randint(0, 61, (2, 15), generator=torch.Generator().manual_seed(0))
    sid = torch.zeros(2, 15, dtype=torch.int32)
    if resets:
        sid[0, 5:] += 1
        sid[0, 14:] += 1
        sid[1, 9:] += 1
    model = _tiny_hybrid(window=window)
    with pytest.raises(AssertionError, match="host read"):  # the default path: single_document()
        with monkeypatch.context() as m:
            _forbid_host_reads(m)
            with _NoHostReads():
                model(tok, seq_idx=sid, labels=tok)
    model.capture_safe = True
    with monkeypatch.context() as m:
        _forbid_host_reads(m)
        with _NoHostReads() as mode:
            out = model(tok, seq_idx=sid, labels=tok)
            forward_ops = mode.ops
            out.loss.backward()
    assert forward_ops > 0 and mode.ops > forward_ops  # the backward ran under the mode too
    assert all(p.grad is not None for p in model.parameters())
    assert torch.isfinite(out.loss.detach())


# the collectives of the TP / SP regions as aten sees them (torch.ops.c10d), in the mode's count
_C10D_OPS = ("allreduce_", "_allgather_base_", "_reduce_scatter_base_", "allgather_into_tensor_coalesced",
             "reduce_scatter_tensor_coalesced")


def _tp_capture_safe_worker(rank, world, sp, pattern):
    """One TP rank (gloo): the TP model's capture-safe forward + backward under _NoHostReads. Returns the c10d
    collectives the mode saw."""
    from megassm.parallel.state import build_groups
    from megassm.parallel.tp import apply_tensor_parallel

    groups = build_groups(tp=world)
    model = _tiny_hybrid(pattern)
    apply_tensor_parallel(model, groups.tp_group, sp=sp)
    tok = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    sid = torch.zeros(2, 16, dtype=torch.int32)
    sid[0, 5:] += 1
    sid[1, 9:] += 1
    return _collectives_of_a_capture_safe_step(model, tok, sid)


def _collectives_of_a_capture_safe_step(model, tok, sid) -> list[str]:
    """One rank's forward + backward under _NoHostReads: first without capture_safe, which must read the
    single-document hint on the host (the check is live in this process; every rank fails at the same point,
    after the embedding's collective, so the ranks stay paired), then with it, which must read nothing. Returns
    the c10d collectives the mode saw (the check covers the parallel regions too)."""
    seen = []

    class Mode(_NoHostReads):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return super().__torch_dispatch__(func, types, args, kwargs)

    with pytest.raises(AssertionError, match="host read"):
        with pytest.MonkeyPatch.context() as m:
            _forbid_host_reads(m)
            with Mode():
                model(tok, seq_idx=sid, labels=tok)
    model.capture_safe = True
    seen.clear()
    with pytest.MonkeyPatch.context() as m:
        _forbid_host_reads(m)
        with Mode():
            out = model(tok, seq_idx=sid, labels=tok)
            out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    return sorted({n for n in seen if n in _C10D_OPS})


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_capture_safe_tensor_parallel_forward_reads_nothing_on_the_host(sp):
    """TP 2 over gloo (CPU), with and without SP, every graph-safe letter (Mamba-2 with ngroups 2, attention,
    MLP, Mamba-1, Longhorn) and document resets: the parallel forward + backward, collectives included, run no
    op that reads a value on the host, as a capture with the collectives inside needs."""
    from multiproc import spawn

    seen = spawn(_tp_capture_safe_worker, 2, sp, "M*M-SL")
    want = {"allreduce_"} | ({"_allgather_base_", "_reduce_scatter_base_"} if sp else set())
    for ops in seen:
        assert want <= set(ops), ops


def _cp_capture_safe_worker(rank, world, pattern, tp, ckpt):
    """One rank of CP 2 (x TP 2 with SP: world 4) over gloo: the capture-safe forward + backward of its slice of
    rows with document resets in every slice (also one across the slice boundary), under _NoHostReads, with
    or without activation checkpointing. Returns the c10d collectives seen."""
    from megassm.parallel.checkpointing import apply_activation_checkpointing
    from megassm.parallel.cp import apply_context_parallel, local_slice
    from megassm.parallel.state import build_groups
    from megassm.parallel.tp import apply_tensor_parallel

    groups = build_groups(tp=tp, cp=world // tp)
    model = _tiny_hybrid(pattern)
    if tp > 1:
        apply_tensor_parallel(model, groups.tp_group, sp=True)
    apply_context_parallel(model, groups.cp_group)
    if ckpt:
        apply_activation_checkpointing(model)
    tok = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(0))
    sid = torch.zeros(2, 32, dtype=torch.int32)
    sid[0, 5:] += 1
    sid[0, 16:] += 1  # a document starting at the second slice's first token
    sid[1, 9:] += 1
    sid[1, 20:] += 1
    tok, sid = local_slice(tok, groups.cp_group), local_slice(sid, groups.cp_group)
    return _collectives_of_a_capture_safe_step(model, tok, sid)


@pytest.mark.parametrize("world, tp, ckpt", [(2, 1, False), (2, 1, True), (4, 2, True)],
                         ids=["cp2", "cp2-ckpt", "tp2-sp-cp2-ckpt"])
def test_capture_safe_context_parallel_forward_reads_nothing_on_the_host(world, tp, ckpt):
    """CP 2 over gloo (CPU; x TP 2 + SP), Mamba-2 and attention with document resets, with and without activation
    checkpointing: the halo / state / K/V all-gathers, the document boundaries' gather, the loss all-reduce and
    their backward reduce-scatters run no op that reads a value on the host, as a capture needs."""
    from multiproc import spawn

    seen = spawn(_cp_capture_safe_worker, world, "M*M-", tp, ckpt)
    for ops in seen:
        assert {"allreduce_", "_allgather_base_", "_reduce_scatter_base_"} <= set(ops), ops


# ----------------------------------------------------------------------------------------------------
# on the device
# ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["M-M-", "MSL-"])
def test_cuda_graph_trains_like_the_eager_loop(tmp_path, pattern):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _graph_trains_like_eager_and_resumes(tmp_path, ("train.steps=6", "train.precision=fp32", "run.save_interval=3"),
                                         pattern)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["M-M-", "M*M-"])
def test_cuda_graph_with_activation_checkpointing_trains_like_the_eager_loop(tmp_path, pattern):
    """The blocks' recomputation captured inside the backward: the same losses, weights and resume as the eager
    loop with checkpointing (and as the graph without it, which computes the same)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    common = ("train.steps=6", "train.precision=fp32", "run.save_interval=3", "train.activation_checkpointing=true",
              *(HYBRID if "*" in pattern else ()))
    _graph_trains_like_eager_and_resumes(tmp_path, common, pattern)


def _graph_trains_like_eager_and_resumes(tmp_path, common, pattern):
    """fp32, 6 steps: the graphed trainer's losses and weights equal the eager one's, and stopped after 3 steps
    and resumed, the resumed trainer captures a new graph and continues exactly. Returns (eager, graphed)."""
    eager = Trainer(_cfg(tmp_path / "eager", *common, pattern=pattern))
    eager_losses = eager.fit()
    graphed = Trainer(_cfg(tmp_path / "graph", *common, "train.cuda_graph=true", pattern=pattern))
    graph_losses = graphed.fit()
    assert graphed.graphed is not None and graphed.graphed.graph is not None
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
    first = Trainer(_cfg(tmp_path / "cut", *common, "train.cuda_graph=true", pattern=pattern))
    first.cfg.train.steps = 3
    head = first.fit()
    resumed = Trainer(_cfg(tmp_path / "cut", *common, "train.cuda_graph=true", "run.resume=auto", pattern=pattern))
    assert resumed.step == 3
    torch.testing.assert_close(torch.tensor(head + resumed.fit()), torch.tensor(graph_losses), rtol=1e-6, atol=1e-7)
    return eager, graphed


@pytest.mark.gpu
def test_cuda_graph_bf16_trains_close_to_eager(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    eager = Trainer(_cfg(tmp_path / "e", "train.steps=6")).fit()
    graph = Trainer(_cfg(tmp_path / "g", "train.steps=6", "train.cuda_graph=true")).fit()
    torch.testing.assert_close(torch.tensor(graph), torch.tensor(eager), rtol=1e-3, atol=1e-4)


def _short_documents(tmp_path) -> str:
    """A corpus of documents of at most 60 bytes: every 80-token row of a batch holds several (document resets
    in every micro-batch, so the eager loop's attention takes its document-mask path, as the graph's does)."""
    from megassm.data_tools.preprocess import preprocess

    g = torch.Generator().manual_seed(0)
    words = ["def", "return", "self", "import", "class", "x", "y", "for", "in", "range", "if", "else", "(", ")", ":"]
    src = tmp_path / "docs.jsonl"
    with open(src, "w") as f:
        for i in range(3000):
            n = int(torch.randint(2, 12, (), generator=g))
            text = " ".join(words[int(j)] for j in torch.randint(0, len(words), (n,), generator=g))[:60]
            f.write(json.dumps({"text": text}) + "\n")
    prefix = str(tmp_path / "short")
    preprocess([str(src)], prefix, quiet=True)
    return prefix


HYBRID = ("model.attn.n_heads=4", "model.attn.n_kv_heads=2")  # GQA, RoPE (the default)


def _assert_resets_in_every_row(cfg, micro_batches: int) -> None:
    """The first micro-batches the trainer will read (a separate pipeline over the same data and seed)."""
    from megassm.data_tools.loader import build_data

    t = cfg.train
    data = build_data(cfg.data, seq_len=t.seq_len, micro_batch=t.micro_batch, global_batch=t.global_batch,
                      seed=t.seed)
    try:
        for _ in range(micro_batches):
            for row in data.next_batch()["seq_idx"]:
                assert bool((row[1:] != row[:-1]).any()), "a row without a document reset"
    finally:
        data.close()


def test_short_documents_give_resets_in_every_row(tmp_path):
    """The corpus of the GPU hybrid test below does what that test relies on (CPU)."""
    prefix = _short_documents(tmp_path)
    _assert_resets_in_every_row(_cfg(tmp_path / "r", "data.builtin=none", f"data.paths=[{prefix}]"), 12)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["M*M-", "*-M*"])
def test_cuda_graph_trains_a_hybrid_like_the_eager_loop(tmp_path, pattern):
    """Attention under the graph: every micro-batch has document resets, so the eager loop takes the same
    document-mask kernel the graph replays; losses, weights and a resume as for Mamba-2 above."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    data = ("data.builtin=none", f"data.paths=[{_short_documents(tmp_path)}]")
    common = (*data, *HYBRID, "train.steps=6", "train.precision=fp32", "run.save_interval=3")
    _assert_resets_in_every_row(_cfg(tmp_path / "eager", *common, pattern=pattern), micro_batches=12)
    eager, graphed = _graph_trains_like_eager_and_resumes(tmp_path, common, pattern)
    assert not eager.model.capture_safe and graphed.model.capture_safe


@pytest.mark.gpu
def test_cuda_graph_bf16_trains_a_hybrid_close_to_eager(tmp_path):
    """bf16 on the stdlib corpus, whose rows mostly hold one document: there the eager loop takes the causal
    kernel and the graph the explicit causal mask (different kernels, so a looser bound than above)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    eager = Trainer(_cfg(tmp_path / "e", *HYBRID, "train.steps=6", pattern="M*M-")).fit()
    graph = Trainer(_cfg(tmp_path / "g", *HYBRID, "train.steps=6", "train.cuda_graph=true", pattern="M*M-")).fit()
    torch.testing.assert_close(torch.tensor(graph), torch.tensor(eager), rtol=5e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capture_safe_attention_on_the_gpu_as_accurate_as_the_causal_kernel(dtype):
    """One document a row on the GPU: the default path runs SDPA's causal kernel, the capture-safe path the
    masked one. Both against an fp64 reference (CPU): the masked path's error is no worse than about the
    causal kernel's, outputs and gradients."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megassm.models.attention import Attention

    cfg = ModelConfig(pattern="*", d_model=64, attn=AttentionConfig(n_heads=4, n_kv_heads=2))
    torch.manual_seed(0)
    ref_attn = Attention(cfg, 2).double()
    u = torch.randn(2, 200, 64, dtype=torch.float64)
    sid = torch.zeros(2, 200, dtype=torch.int32)

    def run(attn, x, single_doc):
        x = x.detach().clone().requires_grad_(True)
        attn.zero_grad(set_to_none=True)
        out, _ = attn(x, seq_idx=sid.to(x.device), single_doc=single_doc)
        out.double().pow(2).sum().backward()
        return [out.detach().double().cpu(), x.grad.double().cpu()] + [p.grad.double().cpu() for p in attn.parameters()]

    ref = run(ref_attn, u, None)
    gpu = Attention(cfg, 2).to("cuda", dtype)
    gpu.load_state_dict(ref_attn.state_dict())
    default = run(gpu, u.to("cuda", dtype), None)
    safe = run(gpu, u.to("cuda", dtype), False)
    for i, (r, d, s_) in enumerate(zip(ref, default, safe)):
        err_default = (d - r).abs().max().item()
        err_safe = (s_ - r).abs().max().item()
        scale = r.abs().max().item()
        slack = (1e-5 if dtype == torch.float32 else 5e-3) * scale
        assert err_safe <= 2 * err_default + slack, \
            f"tensor {i}: error {err_safe:.3g}, the causal kernel's {err_default:.3g}"


# ----------------------------------------------------------------------------------------------------
# tensor and context parallelism under the graph: 2 and 4 GPUs, torchrun over NCCL (device kinds -x2 / -x4)
# ----------------------------------------------------------------------------------------------------
# configs/tiny.yaml (d_model 128, ngroups 1: at TP 2 the Mamba-2 B/C are replicated and the norm group spans
# the ranks; attention 4 heads, 2 KV heads: split), four micro-batches of 2 x 256 tokens a step (accumulation
# 4 at DP 1, 2 at DP 2: both graphs replay), fp32 with the PyTorch kernels, an eager evaluation between the
# steps (TP collectives outside the graphs on the same communicator)
TP_BASE = ["train.steps=4", "train.log_interval=1", "train.eval_interval=2", "train.eval_tokens=2048",
           "train.micro_batch=2", "train.global_batch=8", "train.precision=fp32", "train.device=cuda",
           "run.progress=false", "run.tensorboard=false"]
TP_LAYOUTS = {"tp2": (2, ["parallel.tp=2"]), "tp2-sp": (2, ["parallel.tp=2", "parallel.sp=true"]),
              "tp2-dp2": (4, ["parallel.tp=2"]),
              # the region's backward collective begun (async_op) before in_proj's weight gradient, in the capture
              "tp2-overlap": (2, ["parallel.tp=2", "parallel.tp_overlap=true"]),
              "tp2-sp-overlap": (2, ["parallel.tp=2", "parallel.sp=true", "parallel.tp_overlap=true"]),
              # context parallelism: halo / state / K/V exchanges and the loss all-reduce inside the graphs
              "cp2": (2, ["parallel.cp=2"]),
              "cp2-ckpt": (2, ["parallel.cp=2", "train.activation_checkpointing=true"]),
              "tp2-sp-cp2": (4, ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2"]),
              "cp2-dp2": (4, ["parallel.cp=2"])}
CAPTURED_TP = "with its TP / CP collectives"  # GraphedMicroBatch's log line (rank 0)


def _need_gpus(n):
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs")


def _tp_run(run_dir, nproc, extra=(), resume=None, graph=False) -> dict[int, float]:
    """A torchrun training run of configs/tiny.yaml with TP_BASE; {step: loss}. With `graph`, rank 0's log
    must show both graphs captured with the TP collectives inside."""
    from multiproc import ROOT, launch, losses

    args = ["--config", "configs/tiny.yaml", *TP_BASE, f"run.dir={run_dir}", *extra]
    if graph:
        args.append("train.cuda_graph=true")
    if resume:
        args += ["--resume", str(resume)]
    r = launch(ROOT, args, nproc, env={"MEGASSM_KERNELS": "torch"}, timeout=600)
    assert r.returncode == 0, r.stderr[-5000:]
    if graph:
        if nproc > 1:
            assert CAPTURED_TP in r.stderr, r.stderr[-3000:]
        assert "accumulating micro-batch graph captured" in r.stderr, r.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        return losses([json.loads(line) for line in f])


def _tp_data(tmp_path, pattern) -> list[str]:
    """Pure Mamba-2: the stdlib corpus. Hybrids: short documents, so every row has document resets and the
    eager runs take attention's document-mask kernel, as the graph does."""
    if "*" not in pattern:
        return [f"model.pattern={pattern}"]
    data = [f"model.pattern={pattern}", "data.builtin=none", f"data.paths=[{_short_documents(tmp_path)}]"]
    from multiproc import ROOT

    cfg = load_config(f"{ROOT}/configs/tiny.yaml", [*TP_BASE, *data, f"run.dir={tmp_path / 'check'}"])
    _assert_resets_in_every_row(cfg, micro_batches=16)
    return data


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
@pytest.mark.parametrize("pattern", ["MM", "M*M-"])
def test_cuda_graph_with_tensor_parallelism_trains_like_eager(tmp_path, layout, pattern):
    """TP 2 (+ SP; x DP 2 on 4 GPUs) and CP 2 (+ checkpointing; x TP 2, x DP 2) with train.cuda_graph=true: the
    TP / CP collectives replayed inside the graphs, the replicated gradients' sum, the CP gradient sum and the DP
    all-reduce after them. Losses equal to the same layout's eager
    loop (the one-GPU graph test's tolerance) and to one GPU's eager loop (the TP tests' 1e-4)."""
    n, extra = TP_LAYOUTS[layout]
    _need_gpus(n)
    data = _tp_data(tmp_path, pattern)
    one = _tp_run(tmp_path / "one", 1, data)
    eager = _tp_run(tmp_path / "eager", n, [*data, *extra])
    graph = _tp_run(tmp_path / "graph", n, [*data, *extra], graph=True)
    assert sorted(one) == sorted(eager) == sorted(graph) == [1, 2, 3, 4], (one, eager, graph)
    steps = sorted(one)
    torch.testing.assert_close(torch.tensor([graph[s] for s in steps]), torch.tensor([eager[s] for s in steps]),
                               rtol=1e-5, atol=1e-6)
    assert all(abs(graph[s] - one[s]) <= 1e-4 * abs(one[s]) for s in steps), (graph, one)


@pytest.mark.gpu
def test_cuda_graph_with_tensor_parallelism_resumes_exactly(tmp_path):
    """TP 2 + SP under the graph, stopped after 2 steps and resumed: the resumed run captures new graphs and
    continues as the uninterrupted one (the one-GPU graph test's bound)."""
    _need_gpus(2)
    extra = ["model.pattern=MM", "parallel.tp=2", "parallel.sp=true", "run.save_interval=2"]
    whole = _tp_run(tmp_path / "whole", 2, extra, graph=True)
    _tp_run(tmp_path / "cut", 2, [*extra, "train.steps=2"], graph=True)
    resumed = _tp_run(tmp_path / "cut", 2, extra, resume="auto", graph=True)
    assert sorted(resumed) == [1, 2, 3, 4], resumed
    torch.testing.assert_close(torch.tensor([resumed[s] for s in range(1, 5)]),
                               torch.tensor([whole[s] for s in range(1, 5)]), rtol=1e-6, atol=1e-7)
