"""Pipeline parallelism (megassm/parallel/pp.py) on CPU over gloo, real processes.

Stage balancing and splitting in one process; PP=2 against the single-device model (losses, every
gradient, grad norm, clipped AdamW steps, eval, canonical checkpoint and load) for a pure Mamba-2 and
hybrids, tied and untied, cut at `|` and balanced, 1F1B / GPipe / interleaved, several micro-batches;
PP2 x TP2 (+SP) and PP2 x DP2 on 4 ranks; `torchrun -m megassm.train parallel.pp=2` against the single
process, and checkpoints moving between PP=2 and PP=1 both ways."""
import itertools
import json
import os
import random

import pytest
import torch

from megassm.config import ConfigError, load_config
from megassm.models import build_model
from megassm.parallel.pp import apply_pipeline_parallel, balance_stages, init_stage_weights, split_model, stage_layout

from conftest import use_megatron_groups
from multiproc import losses, spawn, train_records
from parallel_cases import tiny_model_config
from pp_cases import pp_equivalence_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------------
# where the blocks go (one process)
# ----------------------------------------------------------------------------------------------------
def _brute(costs, k, first, last):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        b = (0, *cuts, len(costs))
        loads = [sum(costs[b[s]:b[s + 1]]) + (first if s == 0 else 0) + (last if s == k - 1 else 0) for s in range(k)]
        best = max(loads) if best is None else min(best, max(loads))
    return best


def test_balance_stages_is_optimal_contiguous_and_deterministic():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        costs = [rng.choice([1, 5, 10, 40, 100]) for _ in range(n)]
        first, last = rng.choice([0, 30, 200]), rng.choice([0, 30, 200])
        stages = balance_stages(costs, k, first, last)
        assert [b for s in stages for b in s] == list(range(n)) and len(stages) == k
        assert all(stages)
        loads = [sum(costs[i] for i in s) + (first if j == 0 else 0) + (last if j == k - 1 else 0)
                 for j, s in enumerate(stages)]
        assert max(loads) == _brute(costs, k, first, last), (costs, k, first, last, stages)
        assert balance_stages(costs, k, first, last) == stages  # deterministic
    # ties go to the earliest cuts: the first stage (most activations in flight under 1F1B) is the lightest
    assert balance_stages([1, 1, 1], 2) == [[0], [1, 2]]
    # the embedding / head weigh on the end stages
    assert balance_stages([10] * 8, 2, first_extra=40) == [[0, 1], [2, 3, 4, 5, 6, 7]]
    assert balance_stages([10] * 8, 2, last_extra=40) == [[0, 1, 2, 3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="3 blocks cannot fill 4 stages"):
        balance_stages([1, 1, 1], 4)


def test_stage_layout_cuts_at_bars_or_balances():
    m = build_model(tiny_model_config("M*|M-"), device="meta")
    assert stage_layout(m, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="has 2 stages"):
        stage_layout(m, 4)
    m = build_model(tiny_model_config("MMMMMM"), device="meta")
    assert stage_layout(m, 3) == balance_stages([sum(p.numel() for p in l.parameters()) for l in m.layers], 3,
                                                 m.embedding.weight.numel(),
                                                 m.norm_f.weight.numel() + m.embedding.weight.numel())


@pytest.mark.parametrize("tie", [True, False])
def test_split_keeps_own_stage_with_canonical_weights(tie):
    mcfg = tiny_model_config("M*M-M*", tie=tie)
    full = build_model(mcfg)
    full.init_weights(3)
    ref = full.state_dict()
    for pp, virtual in ((2, 1), (2, 2), (3, 1)):
        for rank in range(pp):
            m = build_model(mcfg, device="meta")
            split_model(m, pp, rank, virtual=virtual)
            plan = m.pp_plan
            m.to_empty(device="cpu")
            init_stage_weights(m, 3)
            assert plan.stage_ids == [rank + c * pp for c in range(virtual)]
            assert len(m.layers) == len(plan.own) == sum(len(plan.layout[s]) for s in plan.stage_ids)
            held = m.state_dict()
            for k, v in held.items():
                assert torch.equal(v, ref[k]), k  # the single-device name, and its single-device init
            assert ("embedding.weight" in held) == (plan.first or (plan.last and tie))
            assert ("norm_f.weight" in held) == plan.last
            assert ("lm_head.weight" in held) == (plan.last and not tie)
            layer_keys = {k.split(".")[1] for k in held if k.startswith("layers.")}
            assert layer_keys == {str(b) for b in plan.own} and m.layers.keys() == plan.own
            apply_pipeline_parallel(m)  # each stage module holds the model's modules under the model's names
            stage_params = [dict(st.named_parameters()) for st in plan.modules]
            assert {k: id(v) for d in stage_params for k, v in d.items()} == {
                k: id(v) for k, v in m.named_parameters()}
    with pytest.raises(RuntimeError, match="already split"):
        split_model(m, 2, 0)
    with pytest.raises(RuntimeError, match="pipeline stages only"):
        m(torch.zeros(1, 4, dtype=torch.long))


# ----------------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------------
BASE = ["data.builtin=stdlib", "train.micro_batch=1", "train.global_batch=4"]


@pytest.mark.parametrize("overrides,match", [
    (["parallel.pp=2", "parallel.world_size=2", "parallel.pp_schedule=zb"], "parallel.pp_schedule"),
    (["parallel.pp_virtual=2"], "parallel.pp_virtual=2 needs parallel.pp > 1"),
    (["parallel.pp=2", "parallel.world_size=2", "model.pattern=M|M|M"], "3 stages"),
    (["parallel.pp=2", "parallel.world_size=2", "model.pattern=MM|"], "at least one block"),
    (["parallel.pp=4", "parallel.world_size=4", "model.pattern=MM-"], "fewer than"),
    (["parallel.pp=2", "parallel.pp_virtual=2", "parallel.world_size=2", "model.pattern=MMMM", "train.global_batch=5"],
     "multiple of"),
])
def test_config_errors_name_the_keys(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, BASE + overrides)


def test_trainer_refuses_pp_with_cp():
    from megassm.training.trainer import check_supported

    cfg = load_config(None, BASE + ["parallel.pp=2", "parallel.cp=2", "parallel.world_size=4"])
    with pytest.raises(ConfigError, match="parallel.pp=2 with parallel.cp=2"):
        check_supported(cfg)


# ----------------------------------------------------------------------------------------------------
# PP against the single-device model (gloo, real processes)
# ----------------------------------------------------------------------------------------------------
CASES_PP2 = [
    dict(model=dict(pattern="MMMM"), n_micro=4),  # pure Mamba-2, tied, balanced, 1F1B
    dict(model=dict(pattern="M*|M-", tie=False), n_micro=3),  # hybrid cut at |, untied
    dict(model=dict(pattern="M*M-M", ngroups=2), schedule="gpipe", n_micro=2, ac=True),  # balanced, GPipe, AC
    dict(model=dict(pattern="MM*M-M"), virtual=2, n_micro=4),  # interleaved 1F1B, 4 stages on 2 ranks
    dict(model=dict(pattern="M-M*"), n_micro=1, seqlen=17),  # one micro-batch (all warm-up), odd length
]


def _check(out, n_cases, tol=1e-5):
    report = json.loads(out.read_text())
    assert len(report) == n_cases
    for rec in report:  # the worker raised on any mismatch; spot-check rank 0's numbers
        assert abs(rec["loss"][0] - rec["loss"][1]) <= tol * abs(rec["loss"][1])
        assert rec["worst_grad_rel"] <= tol and rec["grads_checked"]
        assert rec["ckpt_rel"] is not None and rec["ckpt_rel"] <= 10 * tol
    return report


def test_pp2_matches_single_device(tmp_path, monkeypatch):
    use_megatron_groups(monkeypatch)  # the pipeline and embedding groups from megatron-core, end to end
    out = tmp_path / "pp2.json"
    spawn(pp_equivalence_worker, 2, 1, 2, CASES_PP2, str(out))
    report = _check(out, len(CASES_PP2))
    # rank 0 holds stage 0: the embedding (tied or not) and the first blocks, never the final norm
    assert all("embedding.weight" in r["grads_checked"] and "norm_f.weight" not in r["grads_checked"] for r in report)


def test_pp2_tp2_matches_single_device(tmp_path):
    cases = [dict(model=dict(pattern="M*|M-", tie=False, ngroups=1), n_micro=3),
             dict(model=dict(pattern="MM*M", ngroups=2), sp=True, n_micro=2)]
    out = tmp_path / "pp2tp2.json"
    spawn(pp_equivalence_worker, 4, 2, 2, cases, str(out))
    _check(out, len(cases))


def test_pp4_matches_single_device(tmp_path):
    """Four stages: two middle stages that neither embed nor compute the loss."""
    cases = [dict(model=dict(pattern="M*M-MM"), n_micro=4)]
    out = tmp_path / "pp4.json"
    spawn(pp_equivalence_worker, 4, 1, 4, cases, str(out))
    _check(out, 1)


def test_pp2_dp2_matches_single_device(tmp_path):
    cases = [dict(model=dict(pattern="M*M-"), n_micro=2)]
    out = tmp_path / "pp2dp2.json"
    spawn(pp_equivalence_worker, 4, 1, 2, cases, str(out))
    rec = _check(out, 1)[0]
    assert rec["dp"] == 2


# ----------------------------------------------------------------------------------------------------
# the trainer under torchrun
# ----------------------------------------------------------------------------------------------------
TINY = [
    "data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=64", "model.mamba.d_state=16",
    "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.attn.n_heads=4", "model.attn.n_kv_heads=2",
    "model.mlp.ffn_hidden=128", "train.seq_len=48", "train.micro_batch=2", "train.global_batch=4",
    "train.log_interval=1", "train.eval_interval=2", "train.eval_tokens=384", "optim.warmup_steps=2", "optim.lr=3e-3",
    "run.progress=false", "run.tensorboard=false", "train.steps=4", "run.save_interval=2", "train.device=cpu",
]


def _run(run_dir, nproc=1, extra=(), resume=None):
    records = train_records(run_dir, nproc, extra, resume, base=TINY)
    return losses(records), losses(records, "loss_val")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("pp-train")
    return base, _run(base / "single"), _run(base / "pp2", nproc=2, extra=["parallel.pp=2"])


def _close(a, b, rel=1e-5):
    """Every step of `a` matches `b`."""
    return all(abs(a[s] - b[s]) <= rel * abs(b[s]) for s in a)


def test_torchrun_pp2_matches_single_process(runs):
    _, (single, single_val), (pp2, pp2_val) = runs
    assert sorted(pp2) == [1, 2, 3, 4] and sorted(pp2_val) == [2, 4]
    assert _close(pp2, single), (pp2, single)
    assert _close(pp2_val, single_val), (pp2_val, single_val)


def test_pp2_checkpoint_is_canonical_and_resumes_at_pp1(runs, tmp_path):
    base, (single, _), _ = runs
    path = base / "pp2" / "checkpoints" / "step_00000002"
    cfg = load_config(None, TINY)
    model = build_model(cfg.model, vocab_size=257)
    model.load_state_dict(torch.load(path / "model.pt", weights_only=True), strict=True)  # single-device layout
    optim = torch.load(path / "optim.pt", weights_only=True)
    params = [p for g in model.param_groups(0.1) for p in g["params"]]  # the single-device optimizer's order
    assert sorted(optim["state"]) == list(range(len(params)))
    for idx, st in optim["state"].items():
        assert st["exp_avg"].shape == params[idx].shape
    resumed, _ = _run(tmp_path / "r1", resume=path)
    assert sorted(resumed) == [3, 4] and _close(resumed, single), (resumed, single)


def test_pp1_checkpoint_resumes_at_pp2(runs, tmp_path):
    base, (single, _), _ = runs
    resumed, _ = _run(tmp_path / "r2", nproc=2, extra=["parallel.pp=2"],
                      resume=base / "single" / "checkpoints" / "step_00000002")
    assert sorted(resumed) == [3, 4] and _close(resumed, single), (resumed, single)
