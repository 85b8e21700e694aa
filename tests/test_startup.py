"""Start-up (megassm/training/startup.py): the plans cut the meta model, each rank allocates what it holds and
fills it from the canonical draws dealt out over threads and ranks. The pieces equal the slices of
`init_weights(seed)` bit for bit, whatever the layout (one process, 2 ranks, TP 2 x FSDP2 DP 2); a rank's peak
host memory at start-up under FSDP2 DP 4 stays far below a whole model's, where building the model whole (the
plain `to_empty` + `init_weights` start) costs all of it; and the DDP engine keeps its gradients in DDP's buckets
across steps (no second copy during accumulation)."""
import math
import resource

import pytest
import torch
import torch.distributed as dist

from megassm.models import build_model
from megassm.training.startup import deal, draw_threads, held_parameters, materialize_held

from multiproc import spawn
from parallel_cases import tiny_model_config

PATTERNS = ["M*M-", "MS-L"]  # Mamba-2, attention, MLP; Mamba-1 and Longhorn (rules of their own)


def _reference(pattern: str, tie: bool, seed: int = 3) -> dict:
    m = build_model(tiny_model_config(pattern, tie=tie), device="cpu")
    m.init_weights(seed)
    return m.state_dict()


def _boxes_equal(model, ref: dict) -> list[str]:
    """Names of the held pieces that differ from the reference's slices (empty: all equal)."""
    bad = []
    for name, shape, boxes in held_parameters(model):
        assert tuple(ref[name].shape) == shape, (name, shape)
        for offsets, view in boxes:
            idx = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
            if not torch.equal(view.detach().cpu(), ref[name][idx]):
                bad.append(name)
    return bad


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("tie", [True, False])
def test_materialize_equals_init_weights(pattern, tie, monkeypatch):
    monkeypatch.setenv("MEGASSM_INIT_THREADS", "3")
    m = build_model(tiny_model_config(pattern, tie=tie), device="meta")
    materialize_held(m, "cpu", None, seed=3)
    ref = _reference(pattern, tie)
    got = m.state_dict()
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    # the optimizer's weight-decay policy travels with the rules
    assert all(hasattr(p, "_no_weight_decay") for p in m.parameters())
    # from a state dict (model.init_from) instead of the draws
    m2 = build_model(tiny_model_config(pattern, tie=tie), device="meta")
    materialize_held(m2, "cpu", None, state={k: v + 1 for k, v in ref.items()})
    assert all(torch.equal(v, ref[k] + 1) for k, v in m2.state_dict().items())


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


def _planned(rank, world, tp: int, engine: str, model_cfg: list[str]):
    """The trainer's start-up order on `world` ranks: groups, the meta model cut by the TP plan, the FSDP2 engine
    sharding it, then materialize_held."""
    from megassm.config import load_config
    from megassm.parallel import runtime as prt
    from megassm.parallel.engines import build_engine
    from megassm.parallel.state import build_groups

    cfg = load_config(None, ["data.builtin=stdlib", f"parallel.world_size={world}", f"parallel.tp={tp}",
                             f"parallel.engine={engine}", "train.micro_batch=1", f"train.global_batch={world}",
                             "train.device=cpu", *model_cfg])
    groups = build_groups(tp=tp)
    model = build_model(cfg.model, device="meta")
    model = prt.prepare_model(model, groups, cfg)
    return cfg, groups, model, lambda: build_engine(cfg, model, groups, torch.device("cpu"), bf16=False)


TINY_MODEL = ["model.pattern=M*M-", "model.d_model=32", "model.vocab_size=100", "model.pad_vocab_multiple=16",
              "model.mamba.d_state=8", "model.mamba.headdim=8", "model.mamba.chunk_size=8", "model.attn.n_heads=4",
              "model.attn.n_kv_heads=2", "model.mlp.ffn_hidden=64", "model.tie_embeddings=false"]


def _held_worker(rank, world, tp, engine):
    from megassm.config import load_config

    _, groups, model, engine_of = _planned(rank, world, tp, engine, TINY_MODEL)
    if engine == "fsdp2":  # FSDP2 shards the meta model first: each rank then allocates its DP shard of its TP pieces
        engine_of()
    materialize_held(model, torch.device("cpu"), groups, seed=3)
    if engine != "fsdp2":  # DDP broadcasts real tensors at construction
        engine_of()
    ref_model = build_model(load_config(None, ["data.builtin=stdlib", "parallel.world_size=1", *TINY_MODEL]).model,
                            device="cpu")
    ref_model.init_weights(3)
    held = sum(v.numel() for _, _, boxes in held_parameters(model) for _, v in boxes)
    return _boxes_equal(model, ref_model.state_dict()), held, sum(p.numel() for p in ref_model.parameters())


@pytest.mark.parametrize("tp,engine,world", [(1, "ddp", 2), (2, "fsdp2", 4)], ids=["dp2", "tp2-fsdp2"])
def test_materialize_over_ranks_equals_init_weights(tp, engine, world):
    """Every rank draws its share of the parameters and broadcasts them; each keeps its pieces (TP 2 x FSDP2 over
    DP 2: its DP shard of its TP slices), which equal the single-device init's slices bit for bit."""
    out = spawn(_held_worker, world, tp, engine, timeout=300)
    for rank, (bad, held, total) in enumerate(out):
        assert bad == [], (rank, bad)
        if engine == "fsdp2":  # a quarter of the matmul weights, the small parameters whole (and TP-cut)
            assert held < 0.4 * total, (rank, held, total)
        else:
            assert held == total, (rank, held, total)


# a model big enough for its bytes to show in a process's peak memory (42M parameters, 170 MB in fp32)
BIG_MODEL = ["model.pattern=M-M-M-M-", "model.d_model=768", "model.vocab_size=256", "model.mamba.d_state=16",
             "model.mamba.headdim=64", "model.mlp.ffn_hidden=3072"]


def _peak_worker(rank, world, sharded: bool):
    from megassm.config import load_config

    if sharded:
        _, groups, model, engine_of = _planned(rank, world, 1, "fsdp2", BIG_MODEL)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if sharded:
        engine_of()
        materialize_held(model, torch.device("cpu"), groups, seed=3)
    else:  # the plain start: the whole model on every rank, its init drawn there
        model = build_model(load_config(None, ["data.builtin=stdlib", "parallel.world_size=1", *BIG_MODEL]).model,
                            device="meta")
        model.to_empty(device="cpu")
        model.init_weights(3)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    held = held_parameters(model)
    sizes = [math.prod(shape) for _, shape, _ in held]
    drawn = sum(n for n, owner in zip(sizes, deal(sizes, world)) if owner == rank)
    kept = sum(v.numel() for _, _, boxes in held for _, v in boxes)
    return grew, {"model": 4 * sum(sizes), "kept": 4 * kept, "drawn": 4 * drawn, "largest": 4 * max(sizes)}


def test_startup_peak_host_memory_under_fsdp2_dp4(monkeypatch):
    """FSDP2 over 4 ranks on CPU (the device is the host here): a rank's peak memory grows by the pieces it keeps,
    the draws dealt to it (held until broadcast) and one whole parameter at a time, well under the whole model
    that the plain start holds per rank."""
    monkeypatch.setenv("MEGASSM_INIT_THREADS", "1")
    sharded = spawn(_peak_worker, 4, True, timeout=300)
    plain = spawn(_peak_worker, 4, False, timeout=300)
    for rank, ((grew_sharded, b), (grew_plain, _)) in enumerate(zip(sharded, plain)):
        assert b["model"] > 150e6, b
        bound = b["kept"] + b["drawn"] + b["largest"]
        assert bound < 0.7 * b["model"], (rank, b)  # a quarter kept, a quarter drawn
        assert grew_plain >= 0.9 * b["model"], (rank, grew_plain, b)
        assert grew_sharded <= 1.1 * bound + (16 << 20), (rank, grew_sharded, b)


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
