"""parallel.tp_overlap (parallel/layers.py column_parallel): a Mamba-2 mixer's in_proj, and an MLP's w1 and w3 in
one node, enter the TP region themselves and begin the region's backward all-reduce (SP: reduce-scatter) before
their weight gradients, waiting after them. Over gloo at TP 2, with and without SP, fp32 and bf16 autocast, the
hybrid M*M- with biases (attention keeps the region hook): logits, loss, every gradient and the step's
collectives equal the hook's path bit for bit; and the trainer's losses with the flag equal those without it."""
import json

import pytest
import torch

from megassm.config import ConfigError, load_config

from multiproc import losses, spawn, train_records
from parallel_cases import make_batch, tiny_model_config, twin_models


def overlap_worker(rank, world, sp, precision, out_path, relu2=False):
    from megassm.parallel import comm
    from megassm.parallel.layers import ColumnParallelLinear
    from megassm.parallel.state import build_groups
    from megassm.parallel.tp import _FanOutMLP, apply_tensor_parallel

    groups = build_groups(tp=world)
    if relu2:  # the norm groups span the ranks (ngroups 1 < tp: the Mamba-2 variant holds the entry) and an
        # MLP without w3
        mcfg = tiny_model_config("M*M-", ngroups=1)
        mcfg.mlp.activation = "relu2"
    else:
        mcfg = tiny_model_config("M*M-", ngroups=2, tie=False, proj_bias=True, attn_bias=True)
    hook, entered = twin_models(mcfg, torch.device("cpu"))
    apply_tensor_parallel(hook, groups.tp_group, sp=sp)
    apply_tensor_parallel(entered, groups.tp_group, sp=sp, overlap=True)
    kinds = [layer.kind for layer in entered.layers.values()]
    entries = [type(layer.mixer.in_proj) for layer in entered.layers.values() if layer.kind == "M"]
    assert entries == [ColumnParallelLinear] * 2, entries
    assert [type(layer.mixer) for layer in entered.layers.values() if layer.kind == "-"] == [_FanOutMLP]
    # only attention keeps the region hook
    assert [bool(layer.mixer._forward_pre_hooks) for layer in entered.layers.values()] == [k == "*" for k in kinds]
    assert all(layer.mixer._forward_pre_hooks for layer in hook.layers.values())
    batch = make_batch(mcfg.vocab_size, 2, 24, seed=1)

    def run(model):
        model.zero_grad(set_to_none=True)
        comm.reset_counts()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(batch["tokens"], seq_idx=batch["seq_idx"], labels=batch["labels"])
        fwd = dict(comm.COUNTS)
        comm.reset_counts()
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return out.loss.detach(), grads, fwd, dict(comm.COUNTS)

    lh, gh, fh, bh = run(hook)
    strided = []  # gradients that reach AccumulateGrad with strides other than their parameter's (a strided add)
    for n, p in entered.named_parameters():
        p.register_hook(lambda g, n=n, p=p: strided.append(n) if g.stride() != p.stride() else None)
    le, ge, fe, be = run(entered)
    assert not strided, strided
    differ = [n for n in gh if not torch.equal(gh[n], ge[n])]
    assert torch.equal(lh, le), (lh, le)
    assert not differ, differ
    assert (fh, bh) == (fe, be), ((fh, bh), (fe, be))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"loss": lh.item(), "bwd": bh, "grads": len(gh)}, f)


@pytest.mark.parametrize("sp,precision,relu2", [(False, "fp32", False), (False, "bf16", False), (True, "bf16", False),
                                               (True, "fp32", False), (True, "bf16", True)])
def test_overlap_equals_region_hook(tmp_path, sp, precision, relu2):
    out = tmp_path / "r.json"
    spawn(overlap_worker, 2, sp, precision, str(out), relu2)
    rec = json.loads(out.read_text())
    # the backward still issues one region collective per layer (4 layers) plus the head's input; with norm groups
    # spanning the ranks each Mamba-2 layer adds the all-reduce of its norm statistics
    want = {"all_gather": 5, "reduce_scatter": 5} if sp else {"all_reduce": 5}
    if relu2:
        want["all_reduce"] = want.get("all_reduce", 0) + 2
    assert rec["bwd"] == want, rec


TINY = ["data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=64", "model.mamba.d_state=16",
        "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.attn.n_heads=4", "model.mlp.ffn_hidden=128",
        "train.seq_len=48", "train.micro_batch=2", "train.global_batch=4", "train.log_interval=1", "train.steps=3",
        "train.eval_interval=0", "run.progress=false", "run.save_interval=0", "train.device=cpu",
        "train.precision=bf16", "parallel.tp=2"]


def test_trainer_losses_equal_without_overlap(tmp_path):
    """TP 2 + SP under bf16 autocast with the bf16 weight copies (train.cast_weights_once: in_proj's copy is read
    by ColumnParallelLinear): the same losses with and without the overlap, bit for bit."""
    extra = ["parallel.sp=true", "train.cast_weights_once=true"]
    plain = losses(train_records(tmp_path / "a", 2, extra, base=TINY))
    overlap = losses(train_records(tmp_path / "b", 2, extra + ["parallel.tp_overlap=true"], base=TINY))
    assert sorted(plain) == [1, 2, 3] and plain == overlap, (plain, overlap)


@pytest.mark.parametrize("extra", [["parallel.cp=2", "parallel.sp=true"], ["parallel.pp=2"]], ids=["cp2-sp", "pp2"])
def test_composes_with_context_and_pipeline_parallelism(tmp_path, extra):
    """TP 2 x CP 2 with SP, and TP 2 x PP 2 (4 ranks): the same losses with and without the overlap."""
    base = [a for a in TINY if not a.startswith("train.global_batch")] + ["train.global_batch=8", "train.seq_len=64"]
    plain = losses(train_records(tmp_path / "a", 4, extra, base=base))
    overlap = losses(train_records(tmp_path / "b", 4, extra + ["parallel.tp_overlap=true"], base=base))
    assert sorted(plain) == [1, 2, 3] and plain == overlap, (plain, overlap)


def test_refused_without_tp(monkeypatch):
    from megassm.training.checks import check_supported

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="parallel.tp_overlap=true needs parallel.tp > 1"):
        check_supported(load_config(None, ["data.builtin=stdlib", "parallel.tp_overlap=true"]))
