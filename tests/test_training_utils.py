"""Trainer building blocks: optimizer + LR schedule, checkpoints, metrics (megassm.training)."""
import json
import math
import os
import random
import time

import numpy as np
import pytest
import torch
from torch import nn

from megassm.config import OptimConfig
from megassm.training import checkpoint as ckpt
from megassm.training.checkpoint import disk
from megassm.training.metrics import (
    MetricsLogger, ProgressBar, StepTimer, memory_scalars, peak_memory_gib, short_name,
)
from megassm.training.optim import LRScheduler, build_optimizer, clip_grad_norm, lr_at


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------


class Tiny(nn.Module):
    """Linear layers, a norm, dropout (uses the RNG) and a buffer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.drop = nn.Dropout(0.1)
        self.b = nn.Linear(16, 4, bias=False)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return self.b(self.drop(torch.tanh(self.norm(self.a(x)))))

    def param_groups(self, wd):
        decay = [p for n, p in self.named_parameters() if p.ndim == 2]
        rest = [p for n, p in self.named_parameters() if p.ndim < 2]
        return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


OCFG = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, weight_decay=0.1)


def make(seed=0):
    torch.manual_seed(seed)
    model = Tiny()
    opt = build_optimizer(model.param_groups(OCFG.weight_decay), OCFG, "cpu")
    sched = LRScheduler(opt, OCFG, total_steps=10)
    return model, opt, sched


def train_steps(model, opt, sched, start, n):
    """Steps whose data comes from the global RNGs (torch, numpy, python), so RNG restore matters."""
    losses = []
    for step in range(start, start + n):
        sched.step_to(step)
        x = torch.randn(4, 8) + float(np.random.rand()) + random.random()
        loss = model(x).pow(2).mean()
        loss.backward()
        clip_grad_norm(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def extra_state(sched, step):
    g = torch.Generator().manual_seed(step)  # not the global RNG: the captured state must stay current
    return {
        "scheduler": sched.state_dict(),
        "rng": ckpt.capture_rng_state(),
        "data": {"index": step * 4, "order": [3, 1, 2]},
        "carried_states": [{"conv": torch.randn(2, 3, 3, generator=g), "ssm": torch.randn(2, 2, 4, 5, generator=g)}, None],
        "consumed_tokens": step * 4 * 8,
        "config_hash": "abc123",
    }


# ----------------------------------------------------------------------------------------------------
# optimizer and schedule
# ----------------------------------------------------------------------------------------------------


def test_lr_schedule_shape():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, decay="cosine")
    total = 100
    lrs = [lr_at(s, cfg, total) for s in range(total + 20)]
    assert lrs[0] == pytest.approx(1e-4)  # lr * 1/warmup: the first step is not lr 0
    assert lrs[9] == pytest.approx(1e-3)
    assert all(b > a for a, b in zip(lrs[:10], lrs[1:10]))  # warmup rises
    assert lrs[10] == pytest.approx(1e-3)  # decay starts from lr
    decay = lrs[10:]
    assert all(b <= a for a, b in zip(decay, decay[1:]))  # monotone
    assert all(x >= cfg.min_lr for x in decay)
    assert lrs[total] == pytest.approx(cfg.min_lr) and lrs[-1] == pytest.approx(cfg.min_lr)
    mid = 10 + (total - 10) // 2
    assert lrs[mid] == pytest.approx((cfg.lr + cfg.min_lr) / 2)  # cosine midpoint

    lin = OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=0, decay="linear")
    assert lr_at(0, lin, 10) == pytest.approx(1e-3)
    assert lr_at(5, lin, 10) == pytest.approx(5e-4)
    assert lr_at(10, lin, 10) == 0.0
    const = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=4, decay="constant")
    assert lr_at(1, const, 10) == pytest.approx(5e-4)
    assert lr_at(9, const, 10) == lr_at(50, const, 10) == 1e-3
    # warmup longer than the run: never crashes, decays to min_lr after
    assert lr_at(20, OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=30), 10) == pytest.approx(0.7)
    assert lr_at(40, OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=30), 10) == pytest.approx(0.1)


def test_scheduler_sets_groups_and_round_trips():
    p1, p2 = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    groups = [{"params": [p1], "weight_decay": 0.1}, {"params": [p2], "weight_decay": 0.0, "lr_scale": 0.5},
              {"params": [], "weight_decay": 0.0}]
    opt = build_optimizer(groups, OCFG, "cpu")
    assert len(opt.param_groups) == 2  # the empty group is dropped
    sched = LRScheduler(opt, OCFG, total_steps=10)
    for s in range(6):
        lr = sched.step_to(s)
    assert lr == lr_at(5, OCFG, 10)
    assert [g["lr"] for g in opt.param_groups] == [lr, lr * 0.5]
    state = sched.state_dict()

    opt2 = build_optimizer([{"params": [p1], "weight_decay": 0.1},
                            {"params": [p2], "weight_decay": 0.0, "lr_scale": 0.5}], OCFG, "cpu")
    sched2 = LRScheduler(opt2, OCFG, total_steps=10)
    sched2.load_state_dict(state)
    assert sched2.state_dict() == state
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    assert sched2.step() == sched.step() == lr_at(6, OCFG, 10)


def test_build_optimizer_fused_choice():
    p = [nn.Parameter(torch.randn(3))]
    groups = lambda: [{"params": p, "weight_decay": 0.0}]  # noqa: E731
    auto_cpu = build_optimizer(groups(), OptimConfig(fused="auto"), "cpu")
    assert auto_cpu.defaults["foreach"] is True and not auto_cpu.defaults.get("fused")
    g = auto_cpu.param_groups[0]
    assert g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8
    forced = build_optimizer(groups(), OptimConfig(fused="true"), "cpu")  # torch has a fused CPU AdamW
    assert forced.defaults["fused"] is True
    off = build_optimizer(groups(), OptimConfig(fused="false"), "cuda")
    assert not off.defaults.get("fused")
    p[0].grad = torch.ones(3)
    forced.step()


def test_clip_grad_norm():
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4))
    c = nn.Parameter(torch.zeros(2))  # no grad: skipped
    a.grad = torch.tensor([3.0, 0.0, 0.0])
    b.grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    assert clip_grad_norm([a, b, c], 0) == pytest.approx(5.0)
    assert a.grad[0].item() == 3.0  # max_norm 0: untouched
    assert clip_grad_norm([a, b, c], 10.0) == pytest.approx(5.0)
    assert a.grad[0].item() == 3.0  # below the limit: untouched
    assert clip_grad_norm(iter([a, b]), 1.0) == pytest.approx(5.0)
    total = torch.cat([a.grad, b.grad]).norm().item()
    assert total == pytest.approx(1.0, rel=1e-5)
    a.grad = torch.tensor([float("inf"), 1.0, 0.0])
    assert clip_grad_norm([a, b], 1.0) == float("inf")
    assert a.grad[1].item() == 1.0  # left as it was
    a.grad = torch.tensor([float("nan"), 1.0, 0.0])
    assert math.isnan(clip_grad_norm([a, b], 1.0))
    assert clip_grad_norm([c], 1.0) == 0.0


# ----------------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------------


def test_resume_is_bitwise_exact(tmp_path):
    random.seed(1)
    np.random.seed(1)
    model, opt, sched = make()
    head = train_steps(model, opt, sched, 0, 3)
    path = ckpt.save_checkpoint(tmp_path, 3, model=model, optimizer=opt, extra=extra_state(sched, 3), keep_last=2)
    assert os.path.basename(path) == "step_00000003"
    straight = train_steps(model, opt, sched, 3, 4)
    final_params = {k: v.clone() for k, v in model.state_dict().items()}
    final_opt = opt.state_dict()

    # a fresh process: different init and RNG, then resume
    random.seed(99)
    np.random.seed(99)
    model2, opt2, sched2 = make(seed=7)
    extra = ckpt.load_checkpoint(ckpt.resolve_resume(tmp_path, "auto"), model=model2, optimizer=opt2)
    assert extra["step"] == 3 and extra["consumed_tokens"] == 96 and extra["config_hash"] == "abc123"
    assert extra["complete"] is True and extra["data"] == {"index": 12, "order": [3, 1, 2]}
    assert extra["carried_states"][1] is None and extra["carried_states"][0]["ssm"].shape == (2, 2, 4, 5)
    sched2.load_state_dict(extra["scheduler"])
    ckpt.restore_rng_state(extra["rng"])
    resumed = train_steps(model2, opt2, sched2, 3, 4)

    assert resumed == straight  # identical floats
    for k, v in model2.state_dict().items():
        assert torch.equal(v, final_params[k]), k
    s1, s2 = final_opt["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for i in s1:
        for k in s1[i]:
            assert torch.equal(s1[i][k], s2[i][k]), (i, k)
    assert head  # the first steps ran


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's import touches torch.jit
def test_checkpoint_layout_and_weights_only(tmp_path):
    model, opt, sched = make()
    train_steps(model, opt, sched, 0, 1)
    compiled = torch.compile(model)  # a wrapper: saved in the unwrapped, canonical layout
    path = ckpt.save_checkpoint(tmp_path, 1, model=compiled, optimizer=opt, extra=extra_state(sched, 1))
    assert sorted(os.listdir(path)) == sorted(
        ["model.pt", "optim.pt", "meta.json", "scheduler.pt", "rng.pt", "data.pt", "carried_states.pt"])
    meta = json.load(open(os.path.join(path, "meta.json")))
    assert meta["complete"] is True and meta["step"] == 1 and meta["consumed_tokens"] == 32
    assert "time" in meta and meta["config_hash"] == "abc123"
    for f in ("model.pt", "optim.pt", "rng.pt", "scheduler.pt", "carried_states.pt"):
        torch.load(os.path.join(path, f), weights_only=True)  # no pickled objects
    sd = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    assert set(sd) == set(model.state_dict()) and all(v.device.type == "cpu" for v in sd.values())
    assert not os.listdir(os.path.join(tmp_path, "checkpoints"))[0].startswith(".")
    # saving the same step again replaces it
    ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, extra={"consumed_tokens": 7})
    assert ckpt.read_meta(path)["consumed_tokens"] == 7
    assert os.listdir(os.path.join(tmp_path, "checkpoints")) == ["step_00000001"]
    with pytest.raises(ValueError, match="reserved"):
        ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, extra={"step": 1})


def test_crash_mid_save_leaves_no_complete_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = make()
    first = ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, extra=extra_state(sched, 1))
    real = disk.torch_save

    def crashing(obj, path):
        if path.endswith("optim.pt"):
            raise KeyboardInterrupt("simulated crash while writing")
        real(obj, path)

    monkeypatch.setattr(disk, "torch_save", crashing)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, extra=extra_state(sched, 2), keep_last=1)
    monkeypatch.setattr(disk, "torch_save", real)
    # an interrupted save that Python sees removes its temp directory; a kill -9 leaves it (made here by hand),
    # and it is ignored until the next trainer's clean_temp_dirs removes it
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000001"]
    left = tmp_path / "checkpoints" / f".tmp-step_00000002-{os.getpid() + 1}"
    left.mkdir()
    torch.save({}, left / "model.pt")
    assert ckpt.find_latest(tmp_path) == first  # the temp dir is ignored; step 1 survived keep_last=1
    assert ckpt.resolve_resume(tmp_path, "auto") == first

    # a directory with the final name but no completion marker is ignored, and refused when named
    broken = tmp_path / "checkpoints" / "step_00000005"
    broken.mkdir()
    torch.save({}, broken / "model.pt")
    assert ckpt.find_latest(tmp_path) == first
    with pytest.raises(ckpt.CheckpointError, match="step_00000005.*incomplete"):
        ckpt.resolve_resume(tmp_path, str(broken))
    (broken / "meta.json").write_text(json.dumps({"step": 5, "complete": False}))
    assert ckpt.find_latest(tmp_path) == first
    # a complete marker whose listed file is missing is not complete either
    (broken / "meta.json").write_text(json.dumps({"step": 5, "complete": True, "files": ["model.pt", "optim.pt"]}))
    assert not ckpt.is_complete(str(broken)) and ckpt.find_latest(tmp_path) == first
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.load_checkpoint(broken, model=model, optimizer=opt)

    # the next successful save still works and becomes the latest
    third = ckpt.save_checkpoint(tmp_path, 3, model=model, optimizer=opt, extra={})
    assert ckpt.find_latest(tmp_path) == third


def test_resolve_resume_modes(tmp_path):
    assert ckpt.resolve_resume(tmp_path, "none") is None
    assert ckpt.resolve_resume(tmp_path, None) is None
    assert ckpt.resolve_resume(tmp_path, "auto") is None  # nothing yet: fresh start
    missing = tmp_path / "nope" / "step_00000001"
    with pytest.raises(ckpt.CheckpointError, match=str(missing)):
        ckpt.resolve_resume(tmp_path, str(missing))
    model, opt, _ = make()
    p = ckpt.save_checkpoint(tmp_path / "run", 4, model=model, optimizer=opt)
    assert ckpt.resolve_resume(tmp_path, p) == p
    assert ckpt.resolve_resume(tmp_path, str(tmp_path / "run")) == p  # a run directory: its newest
    assert ckpt.resolve_resume(tmp_path / "run", "auto") == p
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        ckpt.resolve_resume(tmp_path, str(tmp_path / "empty"))


def test_keep_last(tmp_path):
    model, opt, _ = make()
    for step in (1, 2, 3, 4, 5):
        ckpt.save_checkpoint(tmp_path, step, model=model, optimizer=opt, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 5]
    # the checkpoint just written is never deleted, even when older than the ones kept
    ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 4, 5]
    ckpt.save_checkpoint(tmp_path, 6, model=model, optimizer=opt, keep_last=0)  # 0 keeps all
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 4, 5, 6]
    ckpt.save_checkpoint(tmp_path, 7, model=model, optimizer=opt, keep_last=1)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000007"]


def test_rng_round_trip():
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's legacy state
    state = ckpt.capture_rng_state()
    a = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist())
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    ckpt.restore_rng_state(state)
    b = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist())
    assert a == b


# ----------------------------------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------------------------------


def test_metrics_jsonl_and_tensorboard(tmp_path):
    m = MetricsLogger(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        m.log(step, {"loss/train": 2.0 / step, "optim/lr": 1e-3, "optim/grad_norm": torch.tensor(0.5),
                     "throughput/tokens_per_s": 1000.0, "throughput/mfu": 0.3,
                     "memory/max_allocated_gib": 1.5, "time/data_wait_pct": 2.0})
    m.log(3, {"loss/val": 1.5, "loss/val_ppl": math.exp(1.5), "optim/grad_norm": float("nan")})
    m.close()
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [1, 2, 3, 3]
    first = lines[0]
    assert first["loss"] == 2.0 and first["lr"] == 1e-3 and first["grad_norm"] == 0.5
    assert first["tokens_per_s"] == 1000.0 and first["mfu"] == 0.3
    assert first["memory_max_allocated_gib"] == 1.5 and first["time_data_wait_pct"] == 2.0
    assert lines[3]["loss_val"] == 1.5 and "loss_val_ppl" in lines[3]
    assert lines[3]["grad_norm"] is None  # non-finite -> null, the file stays strict JSON
    assert short_name("loss/train") == "loss" and short_name("a/b/c") == "a_b_c"

    events = [f for f in os.listdir(tmp_path / "tensorboard") if f.startswith("events.out.tfevents")]
    assert events
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea_mod.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"loss/train", "optim/lr", "throughput/mfu", "loss/val"} <= set(tags)
    loss = acc.Scalars("loss/train")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([2.0, 1.0, 2.0 / 3])

    # a resumed run appends; resume_step drops what an earlier attempt logged after it
    m = MetricsLogger(tmp_path, tensorboard=False, resume_step=2)
    m.log(3, {"loss/train": 0.5})
    m.close()
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r.get("loss")) for r in lines] == [(1, 2.0), (2, 1.0), (3, 0.5)]


def test_metrics_only_rank0(tmp_path):
    m = MetricsLogger(tmp_path / "r1", rank=1)
    m.log(1, {"loss/train": 1.0})
    m.close()
    assert not os.path.exists(tmp_path / "r1")


def test_progress_bar(capsys):
    bar = ProgressBar(10, 0, enabled=False)
    bar.update(1, loss=1.0, tokens_per_s=5.0)
    bar.write("hidden")
    bar.close()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    bar = ProgressBar(10, 4, enabled=True)
    bar.update(5, loss=1.2345, tokens_per_s=12345.0)
    bar.update(7, loss=1.0, tokens_per_s=2e6)
    bar.write("val loss 1.0")
    bar.close()
    err = capsys.readouterr().err
    assert "7/10" in err and "loss=1.0000" in err and "2.0M" in err and "val loss 1.0" in err


def test_step_timer_and_memory():
    timer = StepTimer("cpu")
    timer.start()
    for _ in range(2):
        with timer.data_wait():
            time.sleep(0.02)
        time.sleep(0.02)
        dt = timer.step_done(tokens=100)
        assert dt >= 0.04
    s = timer.window()
    assert s.steps == 2 and s.tokens == 200
    assert 0.04 <= s.step_time < 1.0 and 0.02 <= s.data_time < s.step_time
    assert s.tokens_per_s == pytest.approx(200 / (2 * s.step_time))
    assert 20.0 < s.data_wait_pct < 80.0
    assert timer.window().steps == 0  # reset
    assert 0.01 < peak_memory_gib("cpu") < 1024
    assert list(memory_scalars(torch.device("cpu"))) == ["memory/host_max_rss_gib"]


# ----------------------------------------------------------------------------------------------------
# the CUDA paths (pytest -m gpu on the device): fused AdamW, CUDA RNG, synchronized timing, peaks
# ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_resume_fused_and_measurements(tmp_path):
    from megassm.training.flops import peak_flops_for

    assert torch.cuda.is_available()
    dev = torch.device("cuda")

    def make_cuda(seed):
        torch.manual_seed(seed)
        model = Tiny().to(dev)
        opt = build_optimizer(model.param_groups(0.1), OCFG, "cuda")
        assert opt.defaults["fused"] is True
        return model, opt, LRScheduler(opt, OCFG, total_steps=10)

    def steps(model, opt, sched, start, n):
        out = []
        for step in range(start, start + n):
            sched.step_to(step)
            x = torch.randn(64, 8, device=dev)  # CUDA RNG; dropout too
            loss = model(x).pow(2).mean()
            loss.backward()
            clip_grad_norm(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        return out

    model, opt, sched = make_cuda(0)
    steps(model, opt, sched, 0, 3)
    path = ckpt.save_checkpoint(tmp_path, 3, model=model, optimizer=opt,
                                extra={"scheduler": sched.state_dict(), "rng": ckpt.capture_rng_state()})
    straight = steps(model, opt, sched, 3, 4)
    model2, opt2, sched2 = make_cuda(5)
    extra = ckpt.load_checkpoint(path, model=model2, optimizer=opt2)
    assert extra["rng"]["torch_cuda"] is not None
    sched2.load_state_dict(extra["scheduler"])
    ckpt.restore_rng_state(extra["rng"])
    assert steps(model2, opt2, sched2, 3, 4) == straight
    for (k, v), v2 in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(v, v2), k

    timer = StepTimer(dev)
    timer.start()
    a = torch.randn(4096, 4096, device=dev)
    for _ in range(3):
        a @ a
        timer.step_done(tokens=1000)
    s = timer.window()
    assert s.steps == 3 and s.tokens_per_s > 0
    assert peak_memory_gib(dev) > 0.05
    assert list(memory_scalars(dev)) == ["memory/max_allocated_gib"]
    name = torch.cuda.get_device_name()
    peak = peak_flops_for(dev)
    print(f"device {name!r}: peak bf16 dense {peak}")
    if any(k in name for k in ("H100", "H200", "A100")):
        assert peak is not None


def test_step_profile_summary_families_overlap_and_top_kernels():
    """summarize_kernels (run.profile_step): union spans, communication not overlapped by compute, the
    families and the top kernels by GPU time, on hand-made kernel spans (microseconds)."""
    from megassm.training.profiling import summarize_kernels

    kernels = [("ncclDevKernel_AllReduce_Sum_bf16", 0, 400), ("nvjet_tst_128x256_gemm", 100, 300),
               ("nvjet_tst_128x256_gemm", 500, 750), ("_ssd_chunk_scan_fwd", 700, 800),
               ("elementwise_kernel<copy>", 800, 850)]
    s = summarize_kernels(kernels, step_ms=1.0)
    assert s["comm_ms"] == 0.4 and s["comm_exposed_ms"] == 0.2  # 100-300 of the all-reduce is overlapped
    assert s["gpu_busy_ms"] == 0.75 and s["idle_share"] == 0.25
    assert s["families"] == {"matmul": 0.45, "nccl": 0.4, "ssd / scan": 0.1, "elementwise / copy / other": 0.05}
    assert s["top"][0] == ["nvjet_tst_128x256_gemm", "matmul", 0.45, 2]
    assert [t[0] for t in s["top"]][-1] == "elementwise_kernel<copy>" and len(s["top"]) == 4


def test_kernel_families_of_our_triton_kernels():
    """family_of names each of our Triton kernels by what it computes (the conv backward's pass 2,
    _conv_dx_kernel, is conv, not the SSD's _dx_kernel)."""
    from megassm.training.profiling import family_of

    expect = {"_conv_dx_kernel": "conv", "_conv_dpre_kernel": "conv", "_conv_fwd_kernel": "conv",
              "_conv_bwd_kernel": "conv", "_dx_kernel": "ssd / scan", "_dcb_kernel": "ssd / scan",
              "_scan_kernel": "ssd / scan", "_states_kernel": "ssd / scan", "_dstates_kernel": "ssd / scan",
              "_gated_bwd_kernel": "norm", "_add_fwd_kernel": "norm", "_cast_kernel": "elementwise / copy / other",
              "_swiglu_bwd_kernel": "elementwise / copy / other", "_cross_entropy_fwd_kernel": "loss",
              "_cross_entropy_bwd_kernel": "loss"}
    assert {k: family_of(k) for k in expect} == expect


def test_dp_gradient_average_in_buckets_equals_the_mean():
    """parallel/dp.allreduce_grads over 2 gloo ranks: every gradient becomes the mean over the ranks, whatever
    the bucket size (one bucket, several, a gradient larger than a bucket reduced in place; two dtypes), and
    parameters without gradients are left alone."""
    from multiproc import spawn

    assert spawn(_dp_average_worker, 2) == [3, 3]


def _dp_average_worker(rank, world):
    import torch.distributed as dist

    from megassm.parallel.dp import allreduce_grads

    shapes = [(3, 5), (7,), (64, 16), (1,), (33,)]
    for bucket_bytes in (1 << 30, 64, 4 * 64 * 16):
        params = [nn.Parameter(torch.zeros(s)) for s in shapes] + [nn.Parameter(torch.zeros(4, dtype=torch.float64))]
        for i, p in enumerate(params):
            g = torch.Generator().manual_seed(100 * i + rank)
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        skipped = nn.Parameter(torch.zeros(2))
        want = []
        for i, p in enumerate(params):
            gs = [torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * i + r), dtype=p.dtype)
                  for r in range(world)]
            want.append(sum(gs) / world)
        allreduce_grads(params + [skipped], dist.group.WORLD, bucket_bytes=bucket_bytes)
        for p, w in zip(params, want):
            torch.testing.assert_close(p.grad, w, rtol=1e-6, atol=1e-7)
        assert skipped.grad is None
        allreduce_grads(params, dist.group.WORLD, bucket_bytes=bucket_bytes, average=False)  # CP's sum
        for p, w in zip(params, want):
            torch.testing.assert_close(p.grad, w * world, rtol=1e-6, atol=1e-7)  # the equal means summed
    return 3  # bucket sizes checked
