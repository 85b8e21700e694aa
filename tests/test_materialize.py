"""Start-up (megassm/parallel/materialize.py): a meta-device model materialized with the canonical weights, the
draws dealt out over threads and ranks, equals `init_weights(seed)` bit for bit; and the DDP engine keeps its
gradients in DDP's buckets across steps (no second copy during accumulation)."""
import os

import pytest
import torch
import torch.distributed as dist

from megassm.models import build_model
from megassm.parallel.materialize import deal, draw_threads, materialize

from multiproc import spawn
from parallel_cases import tiny_model_config

PATTERNS = ["M*M-", "MS-L"]  # Mamba-2, attention, MLP; Mamba-1 and Longhorn (rules of their own)


def _reference(pattern: str, tie: bool, seed: int = 3) -> dict:
    m = build_model(tiny_model_config(pattern, tie=tie), device="cpu")
    m.init_weights(seed)
    return m.state_dict()


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("tie", [True, False])
def test_materialize_equals_init_weights(pattern, tie, monkeypatch):
    monkeypatch.setenv("MEGASSM_INIT_THREADS", "3")
    m = build_model(tiny_model_config(pattern, tie=tie), device="meta")
    materialize(m, "cpu", 3)
    ref = _reference(pattern, tie)
    got = m.state_dict()
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    # the optimizer's weight-decay policy travels with the rules
    assert all(hasattr(p, "_no_weight_decay") for p in m.parameters())


def test_deal_balances_largest_first():
    owner = deal([10, 1, 7, 3, 3], 2)
    loads = [sum(s for s, o in zip([10, 1, 7, 3, 3], owner) if o == r) for r in range(2)]
    assert owner[0] != owner[2] and max(loads) - min(loads) <= 2
    assert deal([5], 4) == [0] and deal([], 3) == []


def test_draw_threads_setting(monkeypatch):
    monkeypatch.setenv("MEGASSM_INIT_THREADS", "5")
    assert draw_threads() == 5
    monkeypatch.setenv("MEGASSM_INIT_THREADS", "zero")
    with pytest.raises(ValueError, match="MEGASSM_INIT_THREADS='zero'"):
        draw_threads()


def _collective(rank, world, pattern, out_dir):
    m = build_model(tiny_model_config(pattern, tie=False), device="meta")
    materialize(m, "cpu", 3)
    torch.save(m.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))


def test_materialize_over_ranks_equals_init_weights(tmp_path):
    """Two ranks, each drawing half of the parameters and broadcasting them: both end with the canonical weights."""
    spawn(_collective, 2, "M*M-", str(tmp_path))
    ref = _reference("M*M-", tie=False)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert all(torch.equal(got[k], ref[k]) for k in ref), r


def _ddp_buckets(rank, world):
    from megassm.config import load_config
    from megassm.parallel.engines import DDPEngine
    from megassm.parallel.state import ParallelGroups
    from megassm.training.optim import build_optimizer

    cfg = load_config(None, ["data.builtin=stdlib", "model.pattern=M-", "model.d_model=32", "model.mamba.headdim=8",
                             "model.mamba.d_state=8", "model.mlp.ffn_hidden=64", "model.vocab_size=64",
                             "parallel.world_size=2", "train.micro_batch=1", "train.global_batch=4"])
    model = build_model(cfg.model, device="cpu")
    model.init_weights(0)
    groups = ParallelGroups(dp=world, dp_rank=rank, rank=rank, world_size=world, dp_group=dist.group.WORLD)
    eng = DDPEngine(model, groups, cfg, torch.device("cpu"))
    eng.make_optimizer(lambda: build_optimizer(model.param_groups(0.1), cfg.optim, "cpu"))
    params = [p for p in model.parameters()]
    tokens = torch.randint(0, 64, (1, 17), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # two steps of two micro-batches
        for i in range(2):
            with eng.micro_batch(last=i == 1):
                out = eng.forward(tokens[:, :-1], labels=tokens[:, 1:])
                eng.backward(out.loss, 2)
            # every gradient is a view of one of DDP's few buckets, in the no_sync micro-batch too
            storages = {p.grad.untyped_storage().data_ptr() for p in params}
            assert len(storages) < len(params) / 2, len(storages)
        eng.clip_and_step(1.0, lambda norm: None)
        assert all(p.grad is not None and not p.grad.any() for p in params)  # zeroed in place


def test_ddp_gradients_live_in_its_buckets():
    spawn(_ddp_buckets, 2)
