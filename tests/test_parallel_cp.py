"""Context parallelism (chunk states passed between ranks) over gloo, as real processes.

CP in {2, 4} and TP x CP = 2 x 2 against the single-device model on the same canonical weights
(tests/cp_cases.py): pure Mamba-2 and the M*M- hybrid with full and sliding-window attention,
rows whose documents cross rank boundaries, resets exactly at rank boundaries, one-token documents, carried
initial states, and two windows chained through their final states with one backward: logits, loss, final
states, every parameter gradient and the initial states' gradients to 1e-5 (fp32). Then the collectives
each forward/backward issues, `torchrun -m megassm.train` with parallel.cp=2 (plain, with DP, TP x CP, and
BPTT + sliding window + activation checkpointing) giving the single-process losses, a CP checkpoint resumed
at CP=1, and the config refusals."""
import json
import os
from functools import partial

import pytest
import torch

from megassm.config import ConfigError, load_config

from conftest import use_megatron_groups
from cp_cases import cp_equivalence_worker
from multiproc import losses, spawn, train_losses, train_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# seqlen 28: 14 tokens per rank at cp=2, 7 at cp=4 (odd); window 9 reaches back over two cp=4 ranks
CASES = [
    dict(pattern="MM", ngroups=2),  # grouped B/C (2 groups of 4 heads)
    dict(pattern="M*M-", tie=False),  # full attention
    dict(pattern="M*M-", window=5),
    dict(pattern="M*M-", window=9, n_kv_heads=1),
]


def _check_counts(rec):
    """Per forward: one all-gather of document-id boundaries, 2 per Mamba-2 layer (halo, states), 1 per
    attention layer (K/V), one all-reduce (loss and token count). The backward (two chained windows)
    reduce-scatters once per all-gather of a layer, and nothing else."""
    n_m, n_a = rec["kinds"].count("M"), rec["kinds"].count("*")
    assert rec["fwd_counts"] == {"all_gather": 1 + 2 * n_m + n_a, "all_reduce": 1}, rec["fwd_counts"]
    assert rec["bwd_counts"] == {"reduce_scatter": 2 * (2 * n_m + n_a)}, rec["bwd_counts"]


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_matches_single_device(tmp_path, monkeypatch, cp):
    if cp == 2:
        use_megatron_groups(monkeypatch)
    out = tmp_path / "report.json"
    spawn(cp_equivalence_worker, cp, cp, 1, CASES, str(out))
    report = json.loads(out.read_text())
    assert len(report) == len(CASES)
    for rec in report:
        for k in ("logits_rel", "loss_rel", "worst_grad_rel", "max_state_rel", "max_init_grad_rel"):
            assert rec[k] <= 1e-5, (k, rec)
        # conv + ssm per Mamba-2 layer, k + v per attention layer: every initial state's gradient checked
        assert len(rec["init_grad_rel"]) == 2 * (rec["kinds"].count("M") + rec["kinds"].count("*"))
        _check_counts(rec)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2-cp2", "tp2-sp-cp2"])
def test_tp2_x_cp2_matches_single_device(tmp_path, sp):
    """TP shards heads first, CP hands over the local heads' states. ngroups=1: B/C replicated over TP and the
    norm statistics summed over ranks; n_kv_heads=1: K/V replicated over TP. With SP the norms and residuals hold [B, L/cp/tp]
    and each TP region gathers this CP slice's sequence, inside which the CP exchange runs unchanged."""
    out = tmp_path / "report.json"
    cases = [dict(pattern="MM", ngroups=1), dict(pattern="M*M-", ngroups=2, window=9, n_kv_heads=1)]
    spawn(cp_equivalence_worker, 4, 2, 2, cases, str(out), "cpu", 1e-5, 28, sp)
    report = json.loads(out.read_text())
    assert [r["tp"] for r in report] == [2, 2] and [r["cp"] for r in report] == [2, 2]
    assert [r["sp"] for r in report] == [sp, sp]
    for rec in report:
        assert rec["worst_grad_rel"] <= 1e-5 and rec["max_state_rel"] <= 1e-5 and rec["logits_rel"] <= 1e-5, rec


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True, "sum"], ids=["plain", "checkpointing", "checkpointing-sum"])
def test_cp2_with_triton_kernels_interpreted(tmp_path, monkeypatch, checkpointing):
    """The Triton SSD / conv / read-out kernels (Triton's CPU interpreter) under CP: the local SSD without an
    initial state, its final state and that state's gradient, seq_idx with global ids, the halo's gradient added
    into the conv's gradient block; with activation checkpointing the blocks are found by the recomputed pieces'
    memory (keeping the block inputs, or their fp32 sum: the Triton norm with its output in the hidden's dtype).
    One Mamba layer: ~25 s each."""
    monkeypatch.setenv("MEGASSM_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "report.json"
    spawn(cp_equivalence_worker, 2, 2, 1, [dict(pattern="M", ngroups=2)], str(out), "cpu", 1e-5, 28, False,
          checkpointing)
    assert json.loads(out.read_text())[0]["worst_grad_rel"] <= 1e-5


def test_cp_layout():
    """The plain-torch fallback's CP groups (order tp-cp-dp-pp, tp fastest); the equivalence workers check
    that megatron-core's groups are among them."""
    from megassm.parallel.state import cp_layout

    assert cp_layout(4, 1, 2) == [[0, 1], [2, 3]]  # CP 2 x DP 2
    assert cp_layout(4, 2, 2) == [[0, 2], [1, 3]]  # TP 2 x CP 2
    assert cp_layout(16, 2, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]


# ----------------------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------------------
TINY = [
    "data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=64", "model.mamba.d_state=16",
    "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.attn.n_heads=4", "model.attn.n_kv_heads=2",
    "model.mlp.ffn_hidden=128", "train.seq_len=48", "train.micro_batch=2", "train.global_batch=4",
    "train.log_interval=1", "train.eval_interval=0", "optim.warmup_steps=2", "optim.lr=3e-3",
    "run.progress=false", "run.tensorboard=false", "train.steps=4", "train.device=cpu",
]


_run = partial(train_losses, base=TINY)
_records = partial(train_records, base=TINY)


def _close(a, b, rel=1e-5):
    return set(a) == set(b) and all(abs(a[s] - b[s]) <= rel * abs(b[s]) for s in b)


@pytest.fixture(scope="module")
def single_records(tmp_path_factory):
    return _records(tmp_path_factory.mktemp("cp-train") / "single", extra=["run.save_interval=2"])


@pytest.fixture(scope="module")
def single(single_records):
    return losses(single_records)


def test_torchrun_cp2_matches_single_process_and_resumes_at_cp1(single, tmp_path):
    cp2 = _run(tmp_path / "cp2", nproc=2, extra=["parallel.cp=2", "run.save_interval=2"])
    assert sorted(cp2) == [1, 2, 3, 4] and _close(cp2, single), (cp2, single)
    # the checkpoint is the single-device one: resume it without CP
    resumed = _run(tmp_path / "r", extra=["run.save_interval=2"], resume=tmp_path / "cp2" / "checkpoints" / "step_00000002")
    assert _close(resumed, {s: single[s] for s in (3, 4)}), (resumed, single)


@pytest.mark.parametrize("extra", [["parallel.cp=2", "parallel.zero_stage=1"], ["parallel.cp=2", "parallel.tp=2"]],
                         ids=["cp2-dp2-distopt", "tp2-cp2"])
def test_torchrun_cp2_on_4_ranks(single_records, tmp_path, extra):
    """The losses and gradient norms of every step equal one process's (the norms catch a gradient off by a constant
    factor, e.g. a CP sum counted twice, which AdamW's normalization hides from the losses)."""
    got = _records(tmp_path / "par", nproc=4, extra=extra)
    for key in ("loss", "grad_norm"):
        assert _close(losses(got, key), losses(single_records, key)), (key, got)


def test_torchrun_cp2_distopt_shards_over_the_cp_ranks(single_records, tmp_path):
    """The distributed optimizer (parallel.zero_stage=1) at DP 1 x CP 2: the AdamW states are sharded over the 2 CP
    ranks (Megatron's layout over DP x CP: the CP ranks hold the same parameters, and the reduce-scatter sums their
    gradients, with no CP all-reduce), overlapped with the backward: the single-process losses, and its checkpoint
    (the states gathered over the CP ranks) resumes at CP 1 exactly."""
    from multiproc import ROOT, launch

    run = tmp_path / "cp2-distopt"
    r = launch(ROOT, ["--config", "configs/tiny.yaml", *TINY, f"run.dir={run}", "parallel.cp=2",
                      "parallel.zero_stage=1", "run.save_interval=2"], 2)
    assert r.returncode == 0, r.stderr[-5000:]
    said = "distributed optimizer over 2 ranks (DP 1 x CP 2): reduce-scatter of fp32 gradients overlapped"
    assert said in r.stderr, r.stderr[-3000:]
    with open(run / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    single = losses(single_records)
    for key in ("loss", "grad_norm"):
        got, ref = losses(records, key), losses(single_records, key)
        assert sorted(got) == [1, 2, 3, 4] and _close(got, ref), (key, got, ref)
    resumed = _run(tmp_path / "r", extra=["run.save_interval=2"], resume=run / "checkpoints" / "step_00000002")
    assert _close(resumed, {s: single[s] for s in (3, 4)}), (resumed, single)


def test_torchrun_tp2_sp_cp2_bptt_chunked_loss(tmp_path):
    """TP 2 with sequence parallelism x CP 2 on 4 ranks, carrying BPTT states and with the head + loss in
    chunks (2 x 6 positions of each 12-position SP shard of a 24-token CP slice): the single-process losses."""
    extra = ["train.bptt=true"]
    one = _run(tmp_path / "one", extra=extra)
    four = _run(tmp_path / "four", nproc=4, extra=[*extra, "parallel.cp=2", "parallel.tp=2", "parallel.sp=true",
                                                   "train.loss_chunk_tokens=12"])
    assert _close(four, one), (four, one)


def test_torchrun_cp2_bptt_window_checkpointing(tmp_path):
    """BPTT with K=2 windows per step, sliding-window attention (its KV cache is carried) and activation
    checkpointing: CP=2 gives the single-process losses."""
    extra = ["train.bptt=true", "train.bptt_windows=2", "model.attn.sliding_window=20",
             "train.activation_checkpointing=true"]
    one = _run(tmp_path / "one", extra=extra)
    two = _run(tmp_path / "two", nproc=2, extra=[*extra, "parallel.cp=2"])
    assert _close(two, one), (two, one)


# ----------------------------------------------------------------------------------------------------
# in-process
# ----------------------------------------------------------------------------------------------------
def _cfg(*over):
    return load_config(None, ["data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=64",
                              "model.mamba.headdim=16", "train.micro_batch=1", "train.global_batch=4",
                              "run.progress=false", *over])


def test_config_refusals(monkeypatch):
    from megassm.training.trainer import check_supported

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"train.seq_len=50 must be divisible by parallel.cp"):
        _cfg("parallel.cp=4", "train.seq_len=50")
    with pytest.raises(ConfigError, match=r"2 tokens per rank is shorter than the Mamba-2 conv halo"):
        _cfg("parallel.cp=4", "train.seq_len=8")
    _cfg("parallel.cp=4", "train.seq_len=8", "model.mamba.d_conv=3")  # halo 2 fits
    check_supported(_cfg("parallel.cp=2"))  # CP x DP
    check_supported(_cfg("parallel.cp=2", "parallel.tp=2"))  # TP x CP
    check_supported(_cfg("parallel.cp=4", "train.bptt=true"))  # BPTT over CP ranks alone
    check_supported(_cfg("parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "train.seq_len=64"))  # SP x CP
    with pytest.raises(ConfigError, match=r"train.seq_len=66 must be divisible by parallel.tp=2 x parallel.cp=2"):
        _cfg("parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "train.seq_len=66")
    check_supported(_cfg("parallel.cp=2", "train.bptt=true"))  # CP x DP: carried states per DP rank
    check_supported(_cfg("parallel.cp=2", "parallel.tp=2", "train.bptt=true"))  # TP x CP (training/bptt.py)
    with pytest.raises(ConfigError, match=r"parallel.pp=2 with parallel.cp=2: pipeline parallelism combined"):
        check_supported(_cfg("parallel.pp=2", "parallel.cp=2", "train.bptt=true"))


def test_local_slice_and_single_rank_noop():
    from megassm.models import build_model
    from megassm.parallel.cp import apply_context_parallel, local_slice
    from parallel_cases import tiny_model_config

    t = torch.arange(12).view(2, 6)
    assert torch.equal(local_slice(t, None), t)
    model = build_model(tiny_model_config("M*M-"))
    assert apply_context_parallel(model, None) is model and not hasattr(model, "cp_plan")


@pytest.mark.parametrize("keep", ["pair", "sum"])
@pytest.mark.parametrize("n_blocks", [0, 2])
def test_activation_checkpointing_same_gradients(n_blocks, keep):
    """train.activation_checkpointing: per-block torch.utils.checkpoint gives the same loss, gradients and
    final states as the plain model (and keeps states flowing through the checkpointed blocks); with
    train.activation_checkpointing_blocks=2 only the first two blocks recompute; keep=sum (the blocks keep the
    fp32 residual sum) computes the same."""
    from megassm.models import build_model
    from megassm.parallel.checkpointing import apply_activation_checkpointing
    from cp_cases import cp_batch
    from parallel_cases import tiny_model_config

    cfg = tiny_model_config("M*M-")
    cfg.attn.sliding_window = 6
    models = []
    for ckpt in (False, True):
        m = build_model(cfg)
        m.init_weights(3)
        if ckpt:
            apply_activation_checkpointing(m, n_blocks, keep=keep)
        b = cp_batch(cfg.vocab_size)
        out = m(b["tokens"], seq_idx=b["seq_idx"], labels=b["labels"], return_states=True)
        (out.loss + out.states[0].ssm.square().sum()).backward()
        models.append((m, out))
    (m0, o0), (m1, o1) = models
    recomputed = [type(b).__name__.startswith("Checkpointed") for b in m1.layers.values()]
    assert recomputed == ([True] * 4 if n_blocks == 0 else [True, True, False, False])
    assert torch.equal(o0.loss, o1.loss)
    assert torch.equal(o0.states[0].ssm, o1.states[0].ssm) and torch.equal(o0.states[1].k, o1.states[1].k)
    for (n, p0), p1 in zip(m0.named_parameters(), m1.parameters()):
        assert torch.allclose(p0.grad, p1.grad, rtol=1e-6, atol=1e-9), n


@pytest.mark.parametrize("keep", ["pair", "sum"])
def test_what_a_checkpointed_block_keeps(keep):
    """After the forward (before the backward), keep=pair holds every block's mixer output (the next block's
    checkpoint input, beside the fp32 residual); keep=sum frees it: only the fp32 sum residual + hidden stays,
    what the next block's recomputation starts from. Under bf16 autocast, as in training (the hidden bf16, the
    sum a new fp32 tensor). An unknown keep is refused by name."""
    import weakref

    from megassm.models import build_model
    from megassm.parallel.checkpointing import apply_activation_checkpointing
    from cp_cases import cp_batch
    from parallel_cases import tiny_model_config

    cfg = tiny_model_config("M*M-")
    m = build_model(cfg)
    m.init_weights(0)
    apply_activation_checkpointing(m, keep=keep)
    refs = []
    for layer in m.layers.values():
        layer.register_forward_hook(lambda mod, args, out: refs.append(weakref.ref(out[0])))
    b = cp_batch(cfg.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(b["tokens"], seq_idx=b["seq_idx"], labels=b["labels"]).loss
    hidden = [r() for r in refs[:-1]]  # the last block's output feeds the final norm, outside any checkpoint
    assert all(h is None or h.dtype == torch.bfloat16 for h in hidden)
    assert [h is not None for h in hidden] == [keep == "pair"] * (len(m.layers) - 1)
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    with pytest.raises(ValueError, match="keep must be one of pair, sum, got 'both'"):
        apply_activation_checkpointing(build_model(cfg), keep="both")


def test_state_readout_gradcheck_and_bf16():
    """The correction y + w (C . h), w = exp(cs) on the slice's first document (kernels.state_readout_add, as
    cp.py calls it; its torch path here): exact gradients in fp64 (gradcheck, 2 groups of 2 heads, a reset
    inside the slice), and under bf16 C the same values and gradients as the fp32 computation up to bf16
    rounding. (The Triton kernels against this path: tests/test_kernels_readout.py.)"""
    from megassm import kernels

    def corrected(y, C, h, cs, alive):
        return kernels.state_readout_add(y, C, h, torch.where(alive[..., None], torch.exp(cs), torch.zeros_like(cs)))

    g = torch.Generator().manual_seed(0)
    Bz, L, G, N, H, P = 2, 5, 2, 3, 4, 2
    C = torch.randn(Bz, L, G, N, generator=g, dtype=torch.float64, requires_grad=True)
    h = torch.randn(Bz, H, P, N, generator=g, dtype=torch.float64, requires_grad=True)
    cs = (-torch.rand(Bz, L, H, generator=g, dtype=torch.float64)).cumsum(1).requires_grad_()
    y = torch.randn(Bz, L, H, P, generator=g, dtype=torch.float64, requires_grad=True)
    alive = torch.ones(Bz, L, dtype=torch.bool)
    alive[0, 3:] = False
    assert torch.autograd.gradcheck(lambda a, c, s, x: corrected(a, c, s, x, alive), (y, C, h, cs))
    # the forward against the formula
    ref = torch.einsum("blgn,bgrpn->blgrp", C, h.view(Bz, G, H // G, P, N)).reshape(Bz, L, H, P)
    ref = y + ref * (torch.exp(cs) * alive[..., None])[..., None]
    assert torch.allclose(corrected(y, C, h, cs, alive), ref)

    C32, h32, cs32 = (t.detach().float().requires_grad_() for t in (C, h, cs))
    Cbf = C32.detach().bfloat16().requires_grad_()
    outs = []
    for c in (C32, Cbf):
        out = corrected(torch.zeros(Bz, L, H, P), c, h32, cs32, alive)
        out.square().sum().backward()
        outs.append(out.detach())
    assert Cbf.grad.dtype == torch.bfloat16 and h32.grad.dtype == torch.float32
    assert torch.allclose(outs[0], outs[1], rtol=3e-2, atol=3e-2)


def test_cp_scaling_fake_world_runs_the_last_rank_alone():
    """benchmarks/cp_scaling.py --fake-world 4 on CPU: one process as the last CP rank of 4 (torch's fake process
    group: it receives every predecessor's states, so it runs the whole fix-up) beside the CP 1 baseline at a
    quarter of the length; under torchrun a fake world is refused."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "benchmarks", "cp_scaling.py")
    args = ["model.d_model=64", "model.pattern=MM", "model.vocab_size=256", "model.mamba.d_state=16",
            "model.mamba.headdim=16", "--device", "cpu", "--fake-world", "4", "--cp", "4", "--lengths", "512",
            "--steps", "1", "--warmup", "0"]
    r = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=root, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["cp"], x["seq_len"], x["status"]) for x in rows[:2]] == [(4, 512, "ok"), (1, 128, "ok")]
    assert rows[2]["summary"][0]["weak_scaling_efficiency"] > 0
    bad = subprocess.run([sys.executable, script, "--fake-world", "2", "--device", "cpu"], capture_output=True,
                         text=True, cwd=root, timeout=120, env=dict(os.environ, WORLD_SIZE="2", OMP_NUM_THREADS="1"))
    assert bad.returncode == 2 and "--fake-world 2: needs K >= 2 and a single process" in bad.stderr
