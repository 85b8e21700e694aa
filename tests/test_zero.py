"""ZeRO-1 (parallel/zero.py) against a plain torch AdamW, over gloo with 3 ranks (an uneven split: parameters
straddle ranks, and a tiny model leaves a rank owning nothing): weights after every step, each rank's share
of the AdamW states, the full state dict, and loading a full state dict back."""
import pytest
import torch
import torch.distributed as dist

from multiproc import spawn


def _params(sizes, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g).to(device)) for s in sizes]


def _groups(ps):
    # two groups with their own weight decay and lr scale, as build_optimizer makes them
    return [{"params": ps[::2], "weight_decay": 0.1, "lr_scale": 1.0, "lr": 1e-2},
            {"params": ps[1::2], "weight_decay": 0.0, "lr_scale": 0.5, "lr": 5e-3}]


def _grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.device)


def _zero_worker(rank, world, sizes, fused_flags, out, device="cpu"):
    from megassm.parallel.zero import FlatParams, ShardedAdamW

    FlatParams.gather_chunk = 4  # the state dict's all-gather in several pieces that cut through parameters
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    ref = _params(sizes, device=device)
    mine = _params(sizes, device=device)
    ref_opt = torch.optim.AdamW(_groups(ref), betas=(0.9, 0.95), eps=1e-8, **fused_flags)
    flat = FlatParams(mine, dist.group.WORLD)
    opt = ShardedAdamW(torch.optim.AdamW(_groups(mine), betas=(0.9, 0.95), eps=1e-8, **fused_flags), flat)
    n = sum(p.numel() for p in mine)
    owned = sum(b - a for _, a, b in flat.pieces)
    assert owned == max(0, min(n, (rank + 1) * -(-n // world)) - rank * -(-n // world)), (rank, owned)
    for step in range(3):
        for grp, lr in zip(opt.param_groups, (1e-2 * (step + 1), 5e-3 * (step + 1))):
            grp["lr"] = lr  # the scheduler writes the full groups; the step must use it
        for grp, lr in zip(ref_opt.param_groups, (1e-2 * (step + 1), 5e-3 * (step + 1))):
            grp["lr"] = lr
        _grads(ref, step)
        _grads(mine, step)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a.data, b.data, rtol=0, atol=1e-6)
            assert a.grad is None
    state_elems = sum(v.numel() for st in opt.state.values() for k, v in st.items() if k != "step")
    assert state_elems == 2 * owned, (state_elems, owned)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in ref_sd["param_groups"]]
    assert [g["lr"] for g in sd["param_groups"]] == [g["lr"] for g in ref_sd["param_groups"]]
    assert sorted(sd["state"]) == sorted(ref_sd["state"])
    for i, st in ref_sd["state"].items():
        assert float(sd["state"][i]["step"]) == float(st["step"]) == 3
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][i][k], st[k].cpu(), rtol=0, atol=1e-7)
    # a fresh sharded optimizer loads the full state and continues exactly as the reference
    again = _params(sizes, seed=1, device=device)
    for a, b in zip(again, ref):
        a.data.copy_(b.data)
    opt2 = ShardedAdamW(torch.optim.AdamW(_groups(again), betas=(0.9, 0.95), eps=1e-8, **fused_flags),
                        FlatParams(again, dist.group.WORLD))
    opt2.load_state_dict(ref_sd)
    _grads(again, 9)
    _grads(ref, 9)
    opt2.step()
    ref_opt.step()
    for a, b in zip(again, ref):
        torch.testing.assert_close(a.data, b.data, rtol=0, atol=1e-6)
    if rank == 0:
        open(out, "w").write("ok")


def _sizes_worker(rank, world, size_sets, flags, out):
    for i, sizes in enumerate(size_sets):
        _zero_worker(rank, world, sizes, flags, f"{out}.{i}")


def test_zero1_matches_adamw_over_three_ranks(tmp_path):
    """Odd sizes that straddle ranks, and a model of 2 elements where rank 2 owns nothing (one spawn)."""
    out = tmp_path / "ok"
    spawn(_sizes_worker, 3, [[(7, 5), (3,), (11, 2), (1,), (4, 4)], [(1,), (1,)]], {"foreach": True}, str(out))
    assert [(tmp_path / f"ok.{i}").read_text() for i in range(2)] == ["ok", "ok"]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_zero1_fused_adamw_over_nccl(world, tmp_path):
    """The CUDA path: fused AdamW over views of the flat buffer, the in-place NCCL all-gather, the state
    dict gathered to the CPU (`pytest -m gpu`)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    out = tmp_path / "ok"
    spawn(_zero_worker, world, [(7, 5), (3,), (1 << 16, 3), (1,)], {"fused": True}, str(out), "cuda",
          backend="nccl")
    assert out.read_text() == "ok"


def test_zero1_refuses_other_optimizers_and_used_ones():
    from megassm.parallel import zero

    class _Flat:
        params = []
        pieces = []

    with pytest.raises(TypeError, match="shards AdamW"):
        zero.ShardedAdamW(torch.optim.SGD(_params([(2,)]), lr=0.1), _Flat())
    ps = _params([(2,)])
    used = torch.optim.AdamW(ps)
    ps[0].grad = torch.ones(2)
    used.step()
    with pytest.raises(ValueError, match="before the first step"):
        zero.ShardedAdamW(used, _Flat())
