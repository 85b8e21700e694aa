"""The distributed optimizer (parallel/distopt.py) over gloo with real processes: against torch AdamW over 3 ranks
(odd sizes, parameters straddling ranks, several buckets, a rank owning nothing): the weights after every step,
each rank's share of the states, the full state dict, loading it back; the bytes a step sends (the formula, one
all-reduce's, against the old ZeRO-1's 1.5x); and the overlap: the last micro-batch's backward starts the
reduce-scatters bucket by bucket, in order, before it ends, and the earlier micro-batches start none. The trainer
runs (DP, TP + SP, CP, PP, clipping, resume) are in test_parallel_engines.py, test_parallel_cp.py and
test_sharded_checkpoint.py."""
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


def _grads(ps, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(p.shape, generator=g).to(p.device) for p in ps]


class _Sent:
    """Bytes this rank sends through the collectives it calls, as ring algorithms move them: (n - 1) / n of the
    whole buffer for a reduce-scatter or an all-gather, twice that for an all-reduce. Wraps torch.distributed's
    functions (the optimizer calls them through the module), so every collective of a step is seen."""

    KINDS = {  # name: (ring passes, the whole buffer's bytes from the call's arguments)
        "reduce_scatter_tensor": (1, lambda out, inp, *_: inp.numel() * inp.element_size()),
        "all_gather_into_tensor": (1, lambda out, inp, *_: out.numel() * out.element_size()),
        "all_reduce": (2, lambda t, *_: t.numel() * t.element_size()),
        "all_gather": (1, lambda outs, inp, *_: len(outs) * inp.numel() * inp.element_size()),
        "broadcast": (1, lambda t, *_: t.numel() * t.element_size()),
    }

    def __init__(self):
        self.bytes, self.calls = 0.0, []
        for name, (passes, size) in self.KINDS.items():
            setattr(dist, name, self._wrap(getattr(dist, name), name, passes, size))

    def _wrap(self, orig, name, passes, size):
        def call(*args, **kwargs):
            n = dist.get_world_size(kwargs.get("group"))
            self.bytes += passes * (n - 1) / n * size(*args)
            self.calls.append(name)
            return orig(*args, **kwargs)
        return call


def _adamw_worker(rank, world, sizes, bucket_bytes, fused_flags, out, device="cpu"):
    from megassm.parallel.distopt import DistributedAdamW, FlatBuffers, distopt_bytes_per_step

    FlatBuffers.gather_chunk = 40  # the state dict's all-gather in pieces that cut through parameters
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    ref = _params(sizes, device=device)
    mine = _params(sizes, device=device)
    ref_opt = torch.optim.AdamW(_groups(ref), betas=(0.9, 0.95), eps=1e-8, **fused_flags)
    buffers = FlatBuffers(mine, dist.group.WORLD, bucket_bytes, dp=world, overlap=False)
    opt = DistributedAdamW(torch.optim.AdamW(_groups(mine), betas=(0.9, 0.95), eps=1e-8, **fused_flags), buffers)
    n = sum(p.numel() for p in mine)
    owned = sum(b - a for _, a, b in buffers.pieces)
    total = torch.tensor([owned], device=device)
    dist.all_reduce(total)
    assert int(total) == n, (int(total), n)  # the slices tile every parameter once
    views = [p.grad for p in mine]
    sent = _Sent()
    for step in range(3):
        for opt_, scale in ((opt, step + 1), (ref_opt, step + 1)):
            for grp, lr in zip(opt_.param_groups, (1e-2, 5e-3)):
                grp["lr"] = lr * scale  # the scheduler writes the full groups; the step must use it
        every = [_grads(ref, step, r) for r in range(world)]
        for i, p in enumerate(ref):
            p.grad = sum(g[i] for g in every) / world  # the DP average
        for p, g in zip(mine, every[rank]):
            p.grad.copy_(g)  # into the buffer's view, as a backward accumulates
        before = sent.bytes
        buffers.reduce_scatter()
        ref_opt.step()
        opt.step()
        # one reduce-scatter and one all-gather per bucket, nothing else: the bytes of one fp32 all-reduce of the
        # buffers, where the old ZeRO-1 (DDP's all-reduce, then the all-gather) sent 1.5x that
        step_bytes = sent.bytes - before
        nb = len(buffers.buckets)
        assert sent.calls[-2 * nb:] == ["reduce_scatter_tensor"] * nb + ["all_gather_into_tensor"] * nb, sent.calls
        assert len(sent.calls) == 2 * nb * (step + 1), sent.calls
        assert step_bytes == pytest.approx(distopt_bytes_per_step(buffers.numel, world), rel=1e-12), step_bytes
        allreduce = 2 * (world - 1) / world * buffers.numel * 4
        assert step_bytes == pytest.approx(allreduce, rel=1e-12), (step_bytes, allreduce)
        assert world == 1 or step_bytes / (allreduce + allreduce / 2) == pytest.approx(2 / 3)
        assert buffers.numel - n < 64 * world * nb + 64 * len(mine)  # padding: parameter starts, bucket ends
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        for a, b in zip(mine, ref):
            torch.testing.assert_close(a.data, b.data, rtol=0, atol=1e-6)
        assert all(p.grad is v and not v.any() for p, v in zip(mine, views))  # zeroed in place, kept
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
    # a fresh distributed optimizer loads the full state and continues as the reference
    again = _params(sizes, seed=1, device=device)
    for a, b in zip(again, ref):
        a.data.copy_(b.data)
    buffers2 = FlatBuffers(again, dist.group.WORLD, bucket_bytes, dp=world, overlap=False)
    opt2 = DistributedAdamW(torch.optim.AdamW(_groups(again), betas=(0.9, 0.95), eps=1e-8, **fused_flags), buffers2)
    opt2.load_state_dict(ref_sd)
    every = [_grads(ref, 9, r) for r in range(world)]
    for i, p in enumerate(ref):
        p.grad = sum(g[i] for g in every) / world
    for p, g in zip(again, every[rank]):
        p.grad.copy_(g)
    buffers2.reduce_scatter()
    opt2.step()
    ref_opt.step()
    for a, b in zip(again, ref):
        torch.testing.assert_close(a.data, b.data, rtol=0, atol=1e-6)
    return len(buffers.buckets), owned


def _cases_worker(rank, world, cases, flags, out):
    return [_adamw_worker(rank, world, sizes, bucket_bytes, flags, out) for sizes, bucket_bytes in cases]


def test_distributed_adamw_matches_adamw_over_three_ranks(tmp_path):
    """Odd sizes in buckets of 256 elements (3 buckets; parameters straddle ranks), and a model of 2 elements where
    rank 2 owns nothing (one spawn)."""
    got = spawn(_cases_worker, 3, [([(7, 5), (3,), (11, 20), (1,), (40, 4), (9,)], 1024), ([(1,), (1,)], 1 << 20)],
                {"foreach": True}, str(tmp_path))
    assert [r[0][0] for r in got] == [3, 3, 3], got  # several buckets
    assert [r[1][1] for r in got] == [1, 1, 0], got  # the tiny model: rank 2 owns nothing
    assert min(r[0][1] for r in got) > 0, got


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_distributed_adamw_fused_over_nccl(world, tmp_path):
    """The CUDA path: fused AdamW over views of the buffers, the in-place NCCL reduce-scatters and all-gathers, the
    state dict gathered to the CPU (`pytest -m gpu`)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    spawn(_adamw_worker, world, [(7, 5), (3,), (1 << 16, 3), (1,)], 1 << 18, {"fused": True}, str(tmp_path), "cuda",
          backend="nccl")


def _overlap_worker(rank, world):
    from megassm.parallel.distopt import FlatBuffers

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    buffers = FlatBuffers(model.parameters(), dist.group.WORLD, 64, dp=world, overlap=True)  # 16 elements a bucket
    params = list(model.parameters())
    done = [0]  # gradients accumulated so far in this backward (hooks registered after the engine's run after them)
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: done.__setitem__(0, done[0] + 1))
    started = []  # (gradients accumulated when a reduce-scatter began, its output)
    orig = dist.reduce_scatter_tensor

    def rs(out, inp, *a, **k):
        started.append((done[0], out.data_ptr()))
        return orig(out, inp, *a, **k)

    dist.reduce_scatter_tensor = rs

    def micro(i):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + i))
        done[0] = 0
        model(x).square().mean().backward()
        y = x
        for j in range(0, 6, 2):
            y = torch.nn.functional.linear(y, ref[j], ref[j + 1])
            y = torch.tanh(y) if j < 4 else y
        y.square().mean().backward()

    micro(0)
    assert started == [], started  # not the last micro-batch: only accumulate
    buffers.arm()
    micro(1)
    nb = len(buffers.buckets)
    assert nb >= 4 and len(started) == nb, (nb, started)  # every bucket began inside the backward
    assert started[0][0] < len(params), started  # the first before the backward's last gradient: overlap
    assert [ptr for _, ptr in started] == [b.grad_shard.data_ptr() for b in buffers.buckets]  # in bucket order
    buffers.reduce_scatter()
    with torch.no_grad():
        for r in ref:
            dist.all_reduce(r.grad)
            r.grad /= world
    for p, r in zip(params, ref):
        for q, a, b in buffers.pieces:
            if q is p:
                torch.testing.assert_close(p.grad.view(-1)[a:b], r.grad.view(-1)[a:b], rtol=1e-6, atol=1e-7)
    # a gradient arriving after its bucket's reduce-scatter began fails loudly
    buffers.zero_grads()
    buffers.arm()
    micro(2)
    with pytest.raises(RuntimeError, match="after its bucket's reduce-scatter began"):
        model(torch.ones(1, 8)).sum().backward()
    buffers.reduce_scatter()
    return nb


def test_overlap_starts_the_buckets_in_the_last_backward():
    assert spawn(_overlap_worker, 2) == [5, 5]


def test_distributed_adamw_refuses_other_optimizers_and_used_ones():
    from megassm.parallel.distopt import DistributedAdamW

    class _Buffers:
        params = []
        pieces = []

    with pytest.raises(TypeError, match="shards AdamW"):
        DistributedAdamW(torch.optim.SGD(_params([(2,)]), lr=0.1), _Buffers())
    ps = _params([(2,)])
    used = torch.optim.AdamW(ps)
    ps[0].grad = torch.ones(2)
    used.step()
    with pytest.raises(ValueError, match="before the first step"):
        DistributedAdamW(used, _Buffers())


def _graph_worker(rank, world):
    from megassm.parallel.distopt import DistributedAdamW, FlatBuffers
    from megassm.training.cuda_graph import GraphedMicroBatch

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(dev)

    model, ref = mlp(), mlp()
    ref.load_state_dict(model.state_dict())
    buffers = FlatBuffers(model.parameters(), dist.group.WORLD, 1024, dp=world, overlap=False)
    opt = DistributedAdamW(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), buffers)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    views = [p.grad for p in model.parameters()]

    def fwd_bwd(batch):
        loss = model(batch["x"]).square().mean()
        (loss / 3).backward()
        return loss.detach()

    graphed = GraphedMicroBatch(list(model.parameters()), fwd_bwd, kept_grads=True)
    for step in range(3):
        graphed.begin_step()
        for m in range(3):
            x = torch.randn(4, 16, device=dev, generator=torch.Generator(dev).manual_seed(10 * step + m))
            graphed({"x": x})
            (ref(x).square().mean() / 3).backward()
        buffers.reduce_scatter()
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        assert all(p.grad is v for p, v in zip(model.parameters(), views))  # the replays wrote into the buffer
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    graphed.release()


@pytest.mark.gpu
def test_cuda_graph_replays_add_into_the_gradient_buffer():
    """train.cuda_graph with the distributed optimizer (`pytest -m gpu`, one GPU, NCCL): one graph captured with
    the buffer's gradient views present, replayed for every micro-batch of 3 steps, accumulates into the buffer
    exactly as the eager loop does into its own gradients (weights after every step)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spawn(_graph_worker, 1, backend="nccl")
