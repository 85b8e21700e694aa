"""Data-parallel engines (parallel.engine: ddp / fsdp2 / deepspeed ZeRO 0-3) through `torchrun -m megassm.train`
on CPU (gloo): DP=2 equals DP=1 with doubled accumulation (losses and final weights), FSDP2 x TP 2 (4 ranks, with
and without SP) equals one process, the canonical checkpoint resumes exactly in any engine (and back in a single
process), BPTT under DDP and FSDP2 (also x TP 2), the DeepSpeed config is derived from ours, and bad layouts are
refused before any model is built."""
import json
import os
from functools import partial

import pytest
import torch

from megassm.config import ConfigError, load_config

from multiproc import losses, train_losses, train_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=64", "model.mamba.d_state=16",
    "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.attn.n_heads=4", "model.attn.n_kv_heads=2",
    "model.mlp.ffn_hidden=128", "train.seq_len=40", "train.micro_batch=2", "train.global_batch=8",
    "train.log_interval=1", "train.eval_interval=0", "optim.warmup_steps=2", "optim.lr=3e-3",
    "run.progress=false", "run.tensorboard=false", "train.steps=4", "run.save_interval=2", "train.device=cpu",
]
ENGINES = {
    "ddp": ["parallel.engine=ddp"],
    "ddp_zero1": ["parallel.engine=ddp", "parallel.zero_stage=1"],
    # many gradient buckets (the tiny model fits DDP's default 25 MB in one): each bucket's all-reduce must fire
    # once per step, in the last micro-batch's backward, and none under no_sync
    "ddp_zero1_buckets": ["parallel.engine=ddp", "parallel.zero_stage=1", "parallel.bucket_mb=0.02"],
    "fsdp2": ["parallel.engine=fsdp2", "train.eval_interval=3", "train.eval_tokens=640"],  # an evaluation between steps: weights released
    "fsdp2_block": ["parallel.engine=fsdp2", "parallel.fsdp_reshard=block", "parallel.fsdp_prefetch=2"],
    "fsdp2_micro": ["parallel.engine=fsdp2", "parallel.fsdp_reshard=micro_batch", "parallel.fsdp_prefetch=0"],
    "zero0": ["parallel.engine=deepspeed", "parallel.zero_stage=0"],
    "zero1": ["parallel.engine=deepspeed", "parallel.zero_stage=1"],
    "zero2": ["parallel.engine=deepspeed", "parallel.zero_stage=2"],
    "zero3": ["parallel.engine=deepspeed", "parallel.zero_stage=3"],
}
# FSDP2 x TP (4 ranks: TP 2 x FSDP2 over DP 2); the tiny model's Mamba-2 B/C (ngroups 1) are TP-replicated rows of
# in_proj, so FSDP2's shards of in_proj hold partial gradients that the TP sync sums
FSDP2_TP = {
    "fsdp2_tp2": ["parallel.engine=fsdp2", "parallel.tp=2"],
    # with parallel.tp_overlap: in_proj (ColumnParallelLinear) under FSDP2's per-block gathers and re-gathers
    "fsdp2_tp2_sp": ["parallel.engine=fsdp2", "parallel.tp=2", "parallel.sp=true", "parallel.fsdp_reshard=block",
                     "parallel.fsdp_prefetch=2", "parallel.tp_overlap=true"],
}


def _has_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # ImportError, or its accelerator probe failing
        return False
    return True


def _needs(name: str):
    if ENGINES[name][0].endswith("deepspeed") and not _has_deepspeed():
        pytest.skip("DeepSpeed is not installed (pip install 'megassm[deepspeed]')")


_run = partial(train_losses, base=TINY, env={"DS_ACCELERATOR": "cpu"}, timeout=400)
_records = partial(train_records, base=TINY, env={"DS_ACCELERATOR": "cpu"}, timeout=400)


def _ckpt(run_dir, step):
    return os.path.join(run_dir, "checkpoints", f"step_{step:08d}")


def _close(a: dict, b: dict, rel=2e-5):
    return sorted(a) == sorted(b) and all(abs(a[s] - b[s]) <= rel * abs(b[s]) for s in b)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("engines") / "single"
    return d, _run(d)


@pytest.mark.parametrize("name", list(ENGINES))
def test_dp2_equals_dp1_with_doubled_accumulation(name, single, tmp_path):
    """2 ranks x accumulation 2 against 1 rank x accumulation 4, same global batch: equal losses at every
    step, equal canonical weights and AdamW moments in the checkpoints."""
    _needs(name)
    ref_dir, ref = single
    got = _run(tmp_path / name, nproc=2, extra=ENGINES[name])
    assert _close(got, ref), (name, got, ref)
    _same_checkpoints(tmp_path / name, ref_dir, 4)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_with_many_reduce_buckets(stage, single, tmp_path):
    """DeepSpeed with reduce buckets far smaller than one backward's gradients (as at 7B: 500M elements of 6.9B;
    the tiny model fits the default one): 2 ranks x 2 micro-batches equal 1 rank x 4. ZeRO-1 reduces only at the
    accumulation boundary, which DeepSpeed learns from hooks on its module's output: the engine's root returns
    the loss tensor (deepspeed_engine.py _LossOnly). Without it the first micro-batch reduced as if it were the
    last, the others were never averaged over DP, and this test fails at step 2."""
    _needs("zero1")
    partial = tmp_path / "buckets.json"  # ~118K parameters in buckets of 20K elements
    partial.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 20000, "allgather_bucket_size": 20000}}))
    _, ref = single
    got = _run(tmp_path / "ds", nproc=2, extra=["parallel.engine=deepspeed", f"parallel.zero_stage={stage}",
                                                f"parallel.deepspeed_config={partial}", "run.save_interval=0"])
    assert _close(got, ref), (stage, got, ref)


def _same_checkpoints(a_dir, b_dir, step: int, groups_exact: bool = False) -> None:
    """The canonical checkpoints (model.pt, optim.pt) of two runs at `step` hold the same weights and AdamW
    moments (rel 1e-4 of each tensor's largest value) in the same optimizer order (groups_exact: and the same
    group hyperparameters)."""
    for fname in ("model.pt", "optim.pt"):
        a = torch.load(os.path.join(_ckpt(a_dir, step), fname))
        b = torch.load(os.path.join(_ckpt(b_dir, step), fname))
        if fname == "optim.pt":
            assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
            assert not groups_exact or a["param_groups"] == b["param_groups"]
            # the names of the optimizer's indices (megassm-checkpoint converts by them)
            assert torch.load(os.path.join(_ckpt(a_dir, step), "param_names.pt")) == \
                torch.load(os.path.join(_ckpt(b_dir, step), "param_names.pt"))
            assert sorted(a["state"]) == sorted(b["state"])
            assert all(float(a["state"][i]["step"]) == float(b["state"][i]["step"]) == step for i in b["state"])
            a = {f"{i}.{k}": v for i, st in a["state"].items() for k, v in st.items() if k != "step"}
            b = {f"{i}.{k}": v for i, st in b["state"].items() for k, v in st.items() if k != "step"}
        assert sorted(a) == sorted(b)
        for k in b:
            scale = b[k].float().abs().max().clamp(min=1e-12)
            assert float((a[k].float() - b[k].float()).abs().max() / scale) < 1e-4, (fname, k)


# FSDP2 x TP against one process: 3 micro-batches per rank (6 in one process), clipping at 0.5 (the gradient
# norms here are 2 to 7: it binds every step), an evaluation after steps 2 and 4 (under FSDP2 it gathers weights
# that no backward frees: released after it)
CLIPPED = ["train.global_batch=12", "train.grad_clip=0.5", "train.eval_interval=2", "train.eval_tokens=640"]


@pytest.fixture(scope="module")
def single_clipped(tmp_path_factory):
    d = tmp_path_factory.mktemp("engines") / "single-clipped"
    return d, _records(d, extra=CLIPPED)


@pytest.mark.parametrize("name", list(FSDP2_TP))
def test_fsdp2_tp2_equals_single_process(name, single_clipped, tmp_path):
    """TP 2 x FSDP2 over DP 2 (4 ranks), 3 micro-batches per rank, clipping that binds: the losses and gradient
    norms of every step, the validation losses, the canonical weights and AdamW moments of the checkpoint
    (gathered over DP and TP) equal one process over the same global batch."""
    ref_dir, ref_records = single_clipped
    got_records = _records(tmp_path / name, nproc=4, extra=FSDP2_TP[name] + CLIPPED)
    ref, got = losses(ref_records), losses(got_records)
    assert _close(got, ref), (name, got, ref)
    norms, ref_norms = losses(got_records, "grad_norm"), losses(ref_records, "grad_norm")
    assert min(ref_norms.values()) > 2 * 0.5, ref_norms  # the clip binds
    assert _close(norms, ref_norms), (name, norms, ref_norms)
    val, ref_val = losses(got_records, "loss_val"), losses(ref_records, "loss_val")
    assert sorted(ref_val) == [2, 4] and _close(val, ref_val), (name, val, ref_val)
    _same_checkpoints(tmp_path / name, ref_dir, 4, groups_exact=True)


@pytest.mark.parametrize("name", ["ddp_zero1", "fsdp2", "zero1", "zero3", "fsdp2_tp2"])
def test_resume_single_process_checkpoint_in_engine(name, single, tmp_path):
    """The canonical checkpoint of a single-process run, resumed at step 2 by a sharded engine (FSDP2 x TP 2: on 4
    ranks, the canonical tensors cut to TP-local ones, then sharded over DP), continues the single-process losses
    exactly."""
    ref_dir, ref = single
    if name in FSDP2_TP:
        got = _run(tmp_path / name, nproc=4, extra=FSDP2_TP[name], resume=_ckpt(ref_dir, 2))
    else:
        _needs(name)
        got = _run(tmp_path / name, nproc=2, extra=ENGINES[name], resume=_ckpt(ref_dir, 2))
    assert _close(got, {s: ref[s] for s in (3, 4)}), (name, got, ref)


def test_zero3_checkpoint_resumes_in_single_process(single, tmp_path):
    _needs("zero3")
    _, ref = single
    _run(tmp_path / "z3", nproc=2, extra=ENGINES["zero3"] + ["train.steps=2"])
    got = _run(tmp_path / "back", resume=_ckpt(tmp_path / "z3", 2))
    assert _close(got, {s: ref[s] for s in (3, 4)}), (got, ref)


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.sp=true"], ["parallel.pp=2"]], ids=["tp2-sp", "pp2"])
def test_distopt_composes_with_tp_and_pp(layout, single_clipped, tmp_path):
    """The distributed optimizer over DP 2 beside TP 2 + SP or PP 2 (4 processes; CP 2 x DP 2:
    tests/test_parallel_cp.py), 3 micro-batches per rank, clipping that binds: the losses and gradient norms of
    every step (the norm from each rank's slices, TP-replicated components once, summed over the stages) and the
    canonical checkpoint's weights and AdamW moments equal one process; under TP the reduce-scatters overlap the
    backward and the TP sum runs on their result; resuming the TP 2 + SP step-2 checkpoint in one process continues
    the losses (the other direction: test_resume_single_process_checkpoint_in_engine)."""
    ref_dir, ref_records = single_clipped
    got_records = _records(tmp_path / "z", nproc=4, extra=ENGINES["ddp_zero1"] + layout + CLIPPED)
    ref, got = losses(ref_records), losses(got_records)
    assert _close(got, ref), (layout, got, ref)
    norms, ref_norms = losses(got_records, "grad_norm"), losses(ref_records, "grad_norm")
    assert min(ref_norms.values()) > 2 * 0.5, ref_norms  # the clip binds
    assert _close(norms, ref_norms), (layout, norms, ref_norms)
    _same_checkpoints(tmp_path / "z", ref_dir, 4, groups_exact=True)
    if "parallel.tp=2" in layout:
        back = losses(_records(tmp_path / "back", extra=CLIPPED, resume=_ckpt(tmp_path / "z", 2)))
        assert _close(back, {s: ref[s] for s in (3, 4)}), (back, ref)


@pytest.mark.parametrize("name", ["ddp", "ddp_zero1", "fsdp2", "fsdp2_tp2"])
def test_bptt_windows_under_engine(name, tmp_path):
    """BPTT with two windows per backward: DDP falls back to the flat all-reduce (logged), the distributed optimizer
    reduce-scatters after the step's backward, FSDP2 (also x TP 2, 4 ranks) takes the carrier's several forwards
    before one backward; all equal the single process."""
    bptt = ["train.bptt=true", "train.bptt_windows=2"]
    ref = _run(tmp_path / "single", extra=bptt)
    if name in FSDP2_TP:
        got = _run(tmp_path / name, nproc=4, extra=bptt + FSDP2_TP[name])
    else:
        got = _run(tmp_path / name, nproc=2, extra=bptt + ENGINES[name])
    assert _close(got, ref), (name, got, ref)


# ----------------------------------------------------------------------------------------------------
# config: derived DeepSpeed JSON, refusals
# ----------------------------------------------------------------------------------------------------


def _cfg(*over):
    return load_config(None, ["data.builtin=stdlib", "model.pattern=M-", "model.d_model=64",
                              "model.mamba.headdim=16", "train.micro_batch=2", "train.global_batch=16",
                              "run.progress=false", *over])


def test_deepspeed_config_is_derived(tmp_path):
    from megassm.parallel.deepspeed_engine import deepspeed_config

    cfg = _cfg("parallel.world_size=4", "parallel.engine=deepspeed", "parallel.zero_stage=3", "train.grad_clip=0.5")
    ds = deepspeed_config(cfg, bf16=True)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (16, 2, 2)
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True} and ds["zero_optimization"]["stage"] == 3
    partial = tmp_path / "offload.json"
    partial.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}))
    ds = deepspeed_config(_cfg("parallel.world_size=4", "parallel.engine=deepspeed", "parallel.zero_stage=3",
                               f"parallel.deepspeed_config={partial}"), bf16=False)
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"] == {"enabled": False}
    shipped = os.path.join(ROOT, "configs", "deepspeed", "zero3-buckets.json")  # the example partial
    ds = deepspeed_config(_cfg("parallel.world_size=4", "parallel.engine=deepspeed", "parallel.zero_stage=3",
                               f"parallel.deepspeed_config={shipped}"), bf16=True)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 200000000 and ds["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize("content,word", [
    ('{"train_batch_size": 64}', "sets 'train_batch_size'"),
    ('{"zero_optimization": {"stage": 2}}', "sets 'zero_optimization.stage'"),
    ('{"bf16": {"enabled": true}}', "sets 'bf16'"),
    ('{"zero_optimization": {\n  "stage" 2}}', ":2:"),
    ("[1, 2]", "JSON object"),
])
def test_deepspeed_partial_refusals_name_file_and_key(content, word, tmp_path):
    from megassm.parallel.engines import check_engine

    partial = tmp_path / "partial.json"
    partial.write_text(content)
    cfg = _cfg("parallel.world_size=2", "parallel.engine=deepspeed", f"parallel.deepspeed_config={partial}")
    with pytest.raises(ConfigError, match=word) as e:
        check_engine(cfg)
    assert str(partial) in str(e.value)


@pytest.mark.parametrize("over,word", [
    (["parallel.world_size=4", "parallel.engine=fsdp2", "parallel.pp=2"], "engine=fsdp2 with parallel.pp=2: "),
    (["parallel.world_size=4", "parallel.engine=fsdp2", "parallel.cp=2", "train.seq_len=64"],
     "engine=fsdp2 with parallel.cp=2: "),
    (["parallel.world_size=8", "parallel.engine=fsdp2", "parallel.tp=2", "parallel.pp=2"],
     "engine=fsdp2 with parallel.pp=2: "),
    (["parallel.world_size=4", "parallel.engine=deepspeed", "parallel.pp=2"], "engine=deepspeed with parallel.pp=2"),
    (["parallel.world_size=4", "parallel.engine=deepspeed", "parallel.tp=2"], "engine=deepspeed with parallel.tp=2"),
    (["parallel.world_size=2", "parallel.engine=ddp", "parallel.zero_stage=2"], "ddp shards the AdamW states"),
    (["parallel.world_size=2", "parallel.engine=fsdp2", "parallel.zero_stage=3"], "zero_stage=3 applies to"),
    (["parallel.world_size=2", "parallel.engine=deepspeed", "train.bptt=true"], "BPTT"),
    (["parallel.world_size=2", "parallel.deepspeed_config=x.json"], "needs parallel.engine=deepspeed"),
])
def test_engine_refusals(over, word):
    from megassm.parallel.engines import check_engine

    with pytest.raises(ConfigError, match=word):
        check_engine(_cfg(*over))


def test_engines_accepted_layouts():
    from megassm.parallel.engines import check_engine

    check_engine(_cfg("parallel.world_size=4", "parallel.engine=ddp", "parallel.tp=2", "parallel.pp=2"))
    check_engine(_cfg("parallel.world_size=8", "parallel.engine=ddp", "parallel.zero_stage=1", "parallel.tp=2",
                      "parallel.pp=2"))
    check_engine(_cfg("parallel.world_size=4", "parallel.engine=fsdp2", "train.bptt=true"))
    check_engine(_cfg("parallel.world_size=4", "parallel.engine=fsdp2", "parallel.tp=2"))  # FSDP2 x TP
    check_engine(_cfg("parallel.world_size=8", "parallel.engine=fsdp2", "parallel.tp=2", "parallel.sp=true"))
    check_engine(_cfg("parallel.world_size=1", "parallel.engine=fsdp2"))  # one DP rank: no engine needed
    if _has_deepspeed():
        check_engine(_cfg("parallel.world_size=8", "parallel.engine=deepspeed", "parallel.zero_stage=3"))
