"""train.compile (training/compile.py): torch.compile over each block's forward. The claim is the eager model's
function: the same losses, outputs and gradients (fp32 within rounding of a different fusion order, bf16 within
the eager bf16 run's own distance from fp32), with document resets, an odd length, carried states and
activation checkpointing, the same parameter names; through the trainer over FSDP2 (gloo, its hooks around the
compiled blocks); refused with the reason where it is not built. Its speed is a benchmark (docs/benchmarks.md
"torch.compile"), not a test."""
import copy
import dataclasses

import pytest
import torch

from megassm.config import AttentionConfig, ConfigError, MambaConfig, MLPConfig, ModelConfig, load_config
from megassm.models import build_model
from megassm.parallel.checkpointing import apply_activation_checkpointing
from megassm.training.checks import check_supported
from megassm.training.compile import compile_blocks

V = 97


def _model(pattern="M*-M-", chunk_size=8):
    cfg = ModelConfig(pattern=pattern, d_model=32, vocab_size=V, tie_embeddings=False,
                      mamba=MambaConfig(d_state=8, headdim=8, chunk_size=chunk_size),
                      attn=AttentionConfig(n_heads=4, n_kv_heads=2), mlp=MLPConfig(ffn_hidden=48))
    m = build_model(cfg, vocab_size=V)
    m.init_weights(seed=0)
    return m


def _batch(L=37, seed=1):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, V, (2, L + 1), generator=g)
    seq_idx = torch.zeros(2, L, dtype=torch.int64)
    seq_idx[0, 11:] = 1  # row 0: three documents, row 1: one
    seq_idx[0, 30:] = 2
    return tok[:, :-1], tok[:, 1:], seq_idx


def _run(model, dtype=None, states=None):
    tok, lab, seq_idx = _batch()
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    with ctx:
        out = model(tok, seq_idx=seq_idx, labels=lab, states=states, return_states=states is not None)
    loss = out.loss
    if states is not None:  # the carried states' gradients too: BPTT backpropagates into them
        loss = loss + sum(s.float().pow(2).mean() for st in out.states for s in _tensors(st))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), grads


def _tensors(state):
    """The floating-point tensors of one block's state (a dataclass of tensors, or None)."""
    if state is None:
        return []
    ts = (getattr(state, f.name) for f in dataclasses.fields(state))
    return [t for t in ts if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _close(a, b, rtol, atol, what):
    # assert_close fails on NaN (equal_nan=False)
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_fp32_equal_to_eager(checkpointing):
    """fp32: loss and every gradient as the eager model's, with document resets and L=37 (not a chunk multiple);
    the module tree and parameter names unchanged (checkpoints stay interchangeable)."""
    ref = _model()
    ours = copy.deepcopy(ref)
    if checkpointing:
        apply_activation_checkpointing(ref)
        apply_activation_checkpointing(ours)
    assert compile_blocks(ours) == ref.n_layers
    assert ours.state_dict().keys() == ref.state_dict().keys()
    lr, gr = _run(ref)
    lo, go = _run(ours)
    _close(lo, lr, 1e-5, 1e-6, "loss")
    assert gr.keys() == go.keys()
    for n in gr:
        _close(go[n], gr[n], 1e-4, 1e-6, n)


def test_bf16_within_eager_error():
    """bf16 autocast: the compiled model's distance from the fp32 model is at most about the eager bf16 model's
    (fusion keeps intermediates in fp32 that eager rounds to bf16, so it may only be closer)."""
    f32 = _model()
    eager = copy.deepcopy(f32)
    ours = copy.deepcopy(f32)
    compile_blocks(ours)
    l32, g32 = _run(f32)
    le, ge = _run(eager, torch.bfloat16)
    lo, go = _run(ours, torch.bfloat16)
    assert torch.isfinite(lo) and torch.isfinite(le)
    assert abs(lo - l32) <= 2 * abs(le - l32) + 1e-3, (lo, le, l32)
    for n in g32:
        err_e = (ge[n] - g32[n]).norm()
        err_o = (go[n] - g32[n]).norm()
        assert torch.isfinite(err_o) and err_o <= 2 * err_e + 1e-3 * g32[n].norm() + 1e-8, (n, err_o, err_e)


def test_carried_states_equal_to_eager():
    """BPTT's path: initial states in, final states out, their gradients through the compiled blocks."""
    ref = _model("M*M-")
    ours = copy.deepcopy(ref)
    compile_blocks(ours)
    tok, _, _ = _batch()
    with torch.no_grad():  # states of an earlier window, detached as BPTT's carrier hands them on
        start = ref(tok, return_states=True).states
    lr, gr = _run(ref, states=start)
    lo, go = _run(ours, states=start)
    _close(lo, lr, 1e-5, 1e-6, "loss")
    for n in gr:
        _close(go[n], gr[n], 1e-4, 1e-6, n)


_TRITON_SCRIPT = """
import copy, torch
from megassm.kernels import dispatch
from megassm.training.compile import compile_blocks
import test_compile as t
ref = t._model("MM", chunk_size=16)  # chunks of 16 or more: the SSD's Triton path
ours = copy.deepcopy(ref)
compile_blocks(ours)
lr, gr = t._run(ref)
lo, go = t._run(ours)
assert dispatch._BACKWARDS, "no backward ran as megassm::backward"
names = sorted({v[3] for v in dispatch._BACKWARDS.values()})
t._close(lo, lr, 1e-5, 1e-6, "loss")
for n in gr:
    t._close(go[n], gr[n], 1e-4, 1e-6, n)
print("BACKWARDS", names)
"""


def test_triton_backward_under_compile():
    """The Triton path (its CPU interpreter): AOTAutograd cannot trace a Triton launch, so each op's Triton backward
    runs as the custom op megassm::backward inside the compiled graph; the result is eager Triton's."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1", "MEGASSM_KERNELS": "triton",
           "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(here), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    names = r.stdout.split("BACKWARDS", 1)[1]
    for op in ("ssd", "causal_conv1d", "gated_rmsnorm", "add_rmsnorm"):
        assert repr(op) in names, (op, names)


TRAIN = ["data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=64", "model.mamba.d_state=16",
         "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.mlp.ffn_hidden=96", "train.seq_len=48",
         "train.micro_batch=2", "train.global_batch=8", "train.steps=3", "train.log_interval=1",
         "train.eval_interval=0", "train.precision=fp32", "optim.warmup_steps=1", "optim.lr=3e-3",
         "run.progress=false", "run.save_interval=0", "run.save_final=false"]


def test_trainer_fsdp2_equal_to_eager(tmp_path):
    """megassm-train with train.compile=true, 2 ranks of FSDP2 over gloo (its all-gather and reshard hooks on the
    compiled blocks): the eager run's losses."""
    from multiproc import losses, train_records

    plain = losses(train_records(tmp_path / "a", 2, ["parallel.engine=fsdp2"], base=TRAIN))
    compiled = losses(train_records(tmp_path / "b", 2, ["parallel.engine=fsdp2", "train.compile=true"], base=TRAIN,
                                    timeout=600))
    assert sorted(plain) == sorted(compiled) == [1, 2, 3], (plain, compiled)
    _close(torch.tensor([compiled[s] for s in (1, 2, 3)]), torch.tensor([plain[s] for s in (1, 2, 3)]), 1e-5, 1e-6,
           "losses")


@pytest.mark.parametrize("world, extra, match", [
    (2, ["parallel.tp=2"], r"parallel.tp=2: "),
    (2, ["parallel.cp=2"], r"parallel.cp=2: "),
    (2, ["parallel.pp=2"], r"parallel.pp=2: "),
    (1, ["train.cuda_graph=true"], r"train.cuda_graph=true: "),
    (1, ["train.fp8=true"], r"train.fp8=true: "),
    (1, ["train.cast_weights_once=true"], r"train.cast_weights_once=true: "),
    (2, ["parallel.engine=deepspeed"], r"parallel.engine=deepspeed: "),
])
def test_refusals_name_the_reason(monkeypatch, world, extra, match):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = load_config(None, TRAIN + ["train.compile=true", f"parallel.world_size={world}", *extra])
    with pytest.raises(ConfigError, match=r"^train.compile=true: " + match):
        check_supported(cfg)


@pytest.mark.gpu
def test_gpu_trainer_equal_to_eager(tmp_path):
    """One GPU, the Triton kernels as custom ops inside the compiled graphs, bf16: the eager run's losses within
    bf16 rounding (inductor's fused glue keeps some intermediates in fp32 that eager rounds to bf16)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from multiproc import losses, train_records

    base = [a for a in TRAIN if a != "train.precision=fp32"] + ["train.precision=bf16", "train.device=cuda"]
    plain = losses(train_records(tmp_path / "a", 1, base=base))
    compiled = losses(train_records(tmp_path / "b", 1, ["train.compile=true"], base=base, timeout=600))
    assert sorted(plain) == sorted(compiled) == [1, 2, 3], (plain, compiled)
    _close(torch.tensor([compiled[s] for s in (1, 2, 3)]), torch.tensor([plain[s] for s in (1, 2, 3)]), 5e-3, 1e-4,
           "losses")
