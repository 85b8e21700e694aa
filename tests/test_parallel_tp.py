"""Tensor (+ sequence) parallelism over gloo, as real processes: TP in {2, 4}, with and without SP, pure
Mamba-2 (ngroups divisible by TP, and TP > ngroups) and the M*M- hybrid. Against the single-device model
on the same canonical weights (every parameter, biases and norm weights included, moved off its init): logits,
loss, every gradient (gathered to the canonical layout), the global grad norm, three clipped AdamW steps, with
any non-finite value failing; and the collectives each layer's forward issues."""
import copy
import importlib.util
import json

import pytest
import torch

from megassm.config import load_config
from megassm.config import ConfigError

from conftest import use_megatron_groups
from multiproc import spawn
from parallel_cases import equivalence_worker, layer_collectives, tiny_model_config

CASES = [
    dict(pattern="MM", ngroups=2),  # tp=2: ngroups % tp == 0 (fast path); tp=4: tp > ngroups > 1 (2 slots)
    dict(pattern="MM", ngroups=1, norm_before_gate=True, proj_bias=True),  # tp > ngroups: B/C replicated
    # hybrid with biases on every projection (row-parallel: added once, after the reduction); n_kv_heads=2:
    # K/V split at tp=2, replicated at tp=4
    dict(pattern="M*M-", tie=False, proj_bias=True, attn_bias=True),
]


# SP with K/V split (tp 2) and replicated K/V / tp > ngroups without SP (tp 4); plain TP 2 and SP at TP 4 run in
# test_parallel_train.py and test_mixers_*.py (the suite's 20-minute budget on 2 cores)
@pytest.mark.parametrize("tp,sp", [(2, True), (4, False)])
def test_tp_matches_single_device(tmp_path, monkeypatch, tp, sp):
    if tp == 2:
        use_megatron_groups(monkeypatch)
    out = tmp_path / "report.json"
    spawn(equivalence_worker, tp, tp, sp, [dict(c) for c in CASES], str(out))
    report = json.loads(out.read_text())
    assert len(report) == len(CASES)
    for rec in report:
        assert rec["worst_grad_rel"] <= 1e-5 and rec["logits_rel"] <= 1e-5 and rec["step_loss_rel"] <= 1e-5, rec
        # one collective per layer forward: the row-parallel all-reduce (SP: its reduce-scatter, plus the
        # all-gather in front of the layer); a Mamba-2 layer whose norm groups span ranks (tp > ngroups) adds
        # the small all-reduce of its norm statistics, forward and backward
        assert rec["per_layer_fwd"] == layer_collectives(rec["case"], rec["kinds"], tp, sp), rec["per_layer_fwd"]
        n = len(rec["kinds"])
        ns = sum(k == "M" for k in rec["kinds"]) if rec["case"].get("ngroups", 1) % tp else 0
        if sp:  # + embedding reduce-scatter, head all-gather, 2 small CE all-reduces
            assert rec["fwd_total"] == {"all_gather": n + 1, "reduce_scatter": n + 1, "all_reduce": 2 + ns}
            assert rec["bwd_total"] == dict({"all_gather": n + 1, "reduce_scatter": n + 1}, **(
                {"all_reduce": ns} if ns else {}))
        else:  # + embedding all-reduce, 2 small CE all-reduces; backward: one per layer + the head's input
            assert rec["fwd_total"] == {"all_reduce": n + 3 + ns}
            assert rec["bwd_total"] == {"all_reduce": n + 1 + ns}


def _cfg(*over):
    return load_config(None, ["data.builtin=stdlib", "model.pattern=M-", "model.d_model=64",
                              "model.mamba.headdim=16", "train.micro_batch=1", "train.global_batch=4",
                              "run.progress=false", *over])


def test_check_supported_allows_tp_cp_pp(monkeypatch):
    from megassm.training.trainer import check_supported

    monkeypatch.setenv("WORLD_SIZE", "2")
    check_supported(_cfg("parallel.tp=2"))
    check_supported(_cfg("parallel.tp=2", "parallel.sp=true"))
    check_supported(_cfg())  # pure data parallel, 2 ranks
    check_supported(_cfg("parallel.cp=2"))  # context parallel (tests/test_parallel_cp.py)
    check_supported(_cfg("parallel.pp=2"))  # pipeline parallel (tests/test_parallel_pp.py)
    check_supported(_cfg("parallel.engine=fsdp2"))  # pure data parallel: engines (test_parallel_engines.py)
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_supported(_cfg("parallel.tp=2", "parallel.engine=fsdp2"))  # FSDP2 x TP (test_parallel_engines.py)
    with pytest.raises(ConfigError, match="engine=fsdp2 with parallel.pp=2"):
        check_supported(_cfg("parallel.pp=2", "parallel.engine=fsdp2"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="sp=true needs parallel.tp"):
        check_supported(_cfg("parallel.sp=true"))
    with pytest.raises(ConfigError, match="torchrun"):
        check_supported(_cfg("parallel.tp=2", "parallel.world_size=2"))
    monkeypatch.setenv("MEGASSM_PROCESS_GROUPS", "megatorch")  # before any process group exists
    with pytest.raises(ConfigError, match="MEGASSM_PROCESS_GROUPS='megatorch': expected one of auto, megatron"):
        check_supported(_cfg())
    # megatron-core asked for by a multi-process run but not installed: refused up front, not a fallback
    monkeypatch.setenv("MEGASSM_PROCESS_GROUPS", "megatron")
    monkeypatch.setenv("WORLD_SIZE", "2")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "megatron" else
                        real_find_spec(name, *a))
    with pytest.raises(ConfigError, match="MEGASSM_PROCESS_GROUPS=megatron, but megatron-core is not installed"):
        check_supported(_cfg())
    monkeypatch.setenv("MEGASSM_PROCESS_GROUPS", "auto")  # auto falls back to the plain builder: no error
    check_supported(_cfg())


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_megatron_groups_on_gloo_match_layout(tmp_path):
    """megatron-core parallel_state builds every group over gloo (4 ranks), and for each layout they are the
    groups of the plain builder (tp, dp, cp, pp, DP x CP and the embedding groups, ranks and indices), laid out
    tp-cp-dp-pp. The rest of the CPU suite builds its groups with the plain builder (conftest.py); a few tests
    go through megatron-core end to end (megatron_groups)."""
    from parallel_cases import layout_worker

    out = tmp_path / "layout.json"
    layouts = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4), (4, 1, 1)]
    spawn(layout_worker, 4, layouts, str(out))
    rec = json.loads(out.read_text())
    assert rec["backend"] == "gloo" and [r["layout"] for r in rec["layouts"]] == [list(x) for x in layouts]
    # rank 0's groups, by hand for two layouts: tp2 x dp2, and tp2 x pp2 (a pipeline is ranks {0, 2})
    assert rec["layouts"][0]["tp"] == [0, 1] and rec["layouts"][0]["dp"] == [0, 2]
    assert rec["layouts"][4]["pp"] == [0, 2] and rec["layouts"][4]["emb"] == [0, 2]
    # ZeRO-1's DP x CP group (Megatron's data-parallel group with context parallel): cp2 x dp2, tp2 x cp2
    assert rec["layouts"][1]["dp_cp"] == [0, 1, 2, 3] and rec["layouts"][3]["dp_cp"] == [0, 2]


@pytest.mark.parametrize("autocast", [False, True])
def test_aligned_linear_matches_linear(autocast):
    """AlignedLinear (a TP-local width that is not a multiple of 8 features: output rows padded in memory) gives
    nn.Linear's output and gradients, under bf16 autocast too, with a padded row stride; its backward reads a
    gradient of either row stride (a split_last buffer keeps the padded one) to the same values."""
    from megassm.parallel.layers import AlignedLinear, out_pad
    from megassm.parallel.substitute import adopt

    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 13)
    al = adopt(AlignedLinear, copy.deepcopy(lin), out_pad=out_pad(13))
    assert al.out_pad == 3
    x = torch.randn(2, 5, 24)
    dy = torch.randn(2, 5, 13)
    res = []
    for m, strided in ((lin, False), (al, False), (al, True)):
        m.zero_grad()
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m(xi)
        if m is al:
            assert y.stride() == (80, 16, 1) and y.shape == (2, 5, 13)
        g = dy.to(y.dtype)
        if strided:  # the gradient as the first 13 of 16-wide rows
            g = torch.zeros(2, 5, 16, dtype=y.dtype)[..., :13].copy_(g)
        y.backward(g)
        res.append((y.detach(), xi.grad, m.weight.grad.clone(), m.bias.grad.clone()))
    for other in res[1:]:
        for u, v, name in zip(res[0], other, ("y", "dx", "dweight", "dbias")):
            assert u.dtype == v.dtype and torch.allclose(u.float(), v.float(), rtol=1e-6, atol=1e-6), name


def test_padded_grad_reads_a_zeroed_buffer_in_place_and_copies_anything_else():
    """The backward of a padded Linear multiplies whole padded rows: a split_last gradient buffer whose padding
    GradBlocks zeroed is used as it is (no copy); any other gradient, strided or not, is copied into zero-padded
    rows (its padding may hold anything: here NaNs, which must not reach the product)."""
    from megassm.kernels.grad_blocks import PAD_ZEROED
    from megassm.parallel.layers import _padded_grad

    base = torch.zeros(2, 5, 16)
    setattr(base, PAD_ZEROED, True)
    g = base[..., :13]
    g.copy_(torch.randn(2, 5, 13))
    full = _padded_grad(g.reshape(-1, 13), 3)
    assert full.data_ptr() == base.data_ptr() and full.shape == (10, 16)
    for other in (torch.full((2, 5, 16), float("nan"))[..., :13].copy_(g), g.clone()):
        full = _padded_grad(other.reshape(-1, 13), 3)
        assert full.data_ptr() != other.data_ptr() and full.shape == (10, 16)
        assert torch.equal(full[:, :13], g.reshape(-1, 13)) and not full[:, 13:].any()


def test_sp_pieces_are_runs_of_tokens():
    """A rank's SP piece of [B, L, d] is the rank-th 1/n of the B * L tokens in memory order, shaped [B, L/n, d]
    (for B = 1 the sequence's piece): the pieces in rank order are the tensor's memory; L must divide by n."""
    from megassm.parallel.sp import tokens_of_rank

    x = torch.randn(3, 8, 5)
    pieces = [tokens_of_rank(x, 4, r) for r in range(4)]
    assert all(p.shape == (3, 2, 5) for p in pieces)
    assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]), x.reshape(-1))
    assert torch.equal(tokens_of_rank(x[:1], 4, 2), x[:1, 4:6])
    with pytest.raises(ValueError, match="sequence length 6 not divisible by 4 ranks"):
        tokens_of_rank(x[:, :6], 4, 0)


def test_tp_pads_only_misaligned_in_proj(monkeypatch):
    """The TP plan pads Mamba-2's in_proj output rows where the rank-local width is not a multiple of 8
    features: the tiny model's 152 become 84 at TP 2 (padded to 88); with headdim 4 (16 heads) they become 88
    and in_proj stays a plain Linear. The shapes alone, on the meta device, with a 2-rank group faked."""
    import dataclasses

    import megassm.parallel.comm as comm
    from megassm.models import build_model
    from megassm.parallel.layers import AlignedLinear
    from megassm.parallel.tp import apply_tensor_parallel

    group = object()
    monkeypatch.setattr(comm, "world", lambda g: 2 if g is group else 1)
    monkeypatch.setattr(comm, "rank", lambda g: 0)
    cfg = tiny_model_config("M")
    for mamba, width, pad in ((cfg.mamba, 84, 4), (dataclasses.replace(cfg.mamba, headdim=4), 88, 0)):
        m = apply_tensor_parallel(build_model(dataclasses.replace(cfg, mamba=mamba), device="meta"), group)
        ip = m.layers["0"].mixer.in_proj
        assert ip.weight.shape[0] == width
        assert (type(ip) is AlignedLinear and ip.out_pad == pad) if pad else type(ip) is torch.nn.Linear


def test_tp_scaling_fake_world_runs_each_rank_alone():
    """benchmarks/tp_scaling.py --fake-world 4 on CPU: one process as rank 0 of 4 (torch's fake process group),
    TP 1 / 2 / 4 each build their rank-local model and train a step with no communication."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["model.d_model=64", "model.pattern=MM", "model.vocab_size=128", "model.mamba.d_state=16",
            "model.mamba.headdim=16", "model.mamba.chunk_size=32", "--configs", "configs/mamba2-2.7b.yaml",
            "--device", "cpu", "--fake-world", "4", "--tp", "1", "2", "4", "--seq-len", "64", "--steps", "1",
            "--warmup", "1"]
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "tp_scaling.py"), *args],
                       capture_output=True, text=True, cwd=root, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["tp"], x["status"], x["fake_world"], x["groups"]) for x in rows] == [
        (1, "ok", 4, 4), (2, "ok", 4, 2), (4, "ok", 4, 1)]
    assert all(x["comm_share"] == 0.0 and x["collective_ms"] == 0.0 for x in rows)
    # under torchrun (WORLD_SIZE > 1) a fake world is refused before any model is built
    bad = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "tp_scaling.py"), "--fake-world", "2",
                          "--device", "cpu"], capture_output=True, text=True, cwd=root, timeout=120,
                         env=dict(os.environ, WORLD_SIZE="2", OMP_NUM_THREADS="1"))
    assert bad.returncode == 2 and "--fake-world 2: needs K >= 1 and a single process" in bad.stderr
    cpu_graph = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "tp_scaling.py"), "--cuda-graph",
                                "--device", "cpu"], capture_output=True, text=True, cwd=root, timeout=120)
    assert cpu_graph.returncode == 2 and "--cuda-graph: CUDA graphs need --device cuda" in cpu_graph.stderr


def test_tp_rank_adds_no_copies_per_mamba2_layer():
    """What one TP rank runs per Mamba-2 layer beyond its share (benchmarks/tp_ops.py: the aten ops of the
    second layer's forward and backward, kernels counted as one op each as on the GPU), ngroups 1 like
    mamba2-2.7b so the norm groups span the ranks: against TP 1, no elementwise op and no copy, cast or fill
    is added, except the clone of the input gradient before its in-place all-reduce (copy_to_tp's backward),
    the zero fill of in_proj's padded weight rows and of its gradient buffer's padding (its local width is not a
    multiple of 8: AlignedLinear) and, under SP, gloo's copy in its reduce-scatter; the launches added are the collectives and the norm's
    two statistics kernels. The host reads of the step are TP 1's (the clip's one .item())."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--patterns", "MM", "--tp", "1", "2", "--sp", "off", "on", "--batch", "2", "--d-model", "64",
            "--d-state", "16", "--headdim", "16", "--chunk-size", "32", "--seq-len", "64", "--vocab", "128", "--ngroups", "1"]
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "tp_ops.py"), *args], capture_output=True,
                       text=True, cwd=root, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]

    def layer(tp, sp, phase):
        row = next(x for x in rows if (x["tp"], x["sp"], x["phase"], x["where"]) == (tp, sp, phase, "1:M"))
        fam = row["families"]
        n = {f: fam.get(f, [0, 0])[0] for f in ("copy", "cast", "fill", "elementwise", "kernel", "comm")}
        return dict(copy_like=n["copy"] + n["cast"] + n["fill"], elementwise=n["elementwise"], kernel=n["kernel"],
                    comm=n["comm"], launches=row["launches"])

    one = {ph: layer(1, False, ph) for ph in ("fwd", "bwd")}
    # extra ops per layer on a TP 2 rank: (copy-like, kernels, collectives) forward / backward. The forward's
    # one copy-like op: in_proj's local width here is 164 features, so its output rows are padded to 168
    # (AlignedLinear): the zero fill of the weight copy's 4 pad rows (its cast is autocast's own); the backward's
    # two: in_proj's output gradient into zero-padded rows (a fill and a copy: without the Triton backwards,
    # split_last's gradient is a cat; on the GPU it is the GradBlocks buffer, its padding zeroed by one fill)
    extra = {False: {"fwd": (1, 1, 2), "bwd": (3, 1, 2)},  # sumsq / bwd_dot kernels; norm stats + out_proj
             True: {"fwd": (2, 1, 3), "bwd": (3, 1, 3)}}  # + the SP all-gather; gloo's reduce-scatter copy
    for sp in (False, True):
        for ph in ("fwd", "bwd"):
            got, base = layer(2, sp, ph), one[ph]
            cl, kn, cm = extra[sp][ph]
            want = dict(copy_like=base["copy_like"] + cl, elementwise=base["elementwise"], kernel=base["kernel"] + kn,
                        comm=cm, launches=base["launches"] + cl + kn + cm)
            assert got == want, (sp, ph, got, want, base)
        reads = next(x for x in rows if (x["tp"], x["sp"], x["where"]) == (2, sp, "host_reads"))["host_reads"]
        assert [h["at"].split(":")[0] for h in reads] == ["megassm/parallel/tp.py"] and reads[0]["n"] == 1, reads
