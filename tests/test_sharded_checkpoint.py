"""Sharded checkpoints (run.checkpoint_format=sharded, training/checkpoint/sharded.py): saved at DP 2 under ddp / fsdp2 / the
distributed optimizer (torchrun, gloo), resumed at DP 1, TP 2, PP 2, under another engine and at DP 4 with the
losses of the uninterrupted run; the chunk geometry; async saves (the snapshot at the step boundary, the write in
the background, an interrupted write never complete-looking, keep_last sparing it); megassm-checkpoint convert both
ways, bit for bit, and its refusals."""
import json
import os
import shutil
import threading
from functools import partial

import pytest
import torch

from megassm.config import ConfigError, load_config
from megassm.training import checkpoint as ckpt
from megassm.training.checkpoint import sharded, sharded_chunks

from multiproc import train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=64", "model.mamba.d_state=16",
    "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.attn.n_heads=4", "model.attn.n_kv_heads=2",
    "model.mlp.ffn_hidden=128", "train.seq_len=40", "train.micro_batch=2", "train.global_batch=8",
    "train.log_interval=1", "train.eval_interval=0", "optim.warmup_steps=2", "optim.lr=3e-3",
    "run.progress=false", "run.tensorboard=false", "train.steps=4", "run.save_interval=2", "train.device=cpu",
]
SHARDED = ["run.checkpoint_format=sharded"]


def _ckpt(run_dir, step):
    return os.path.join(run_dir, "checkpoints", f"step_{step:08d}")


def _close(a: dict, b: dict, rel=2e-5):
    return sorted(a) == sorted(b) and all(abs(a[s] - b[s]) <= rel * abs(b[s]) for s in b)


# ----------------------------------------------------------------------------------------------------
# geometry
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 3, 2), ()])
def test_flat_boxes_tile_any_range(shape):
    from megassm.parallel.distopt import flat_boxes

    n = max(1, int(torch.tensor(shape).prod()) if shape else 1)
    full = torch.arange(n).view(shape)
    for a in range(n):
        for b in range(a + 1, n + 1):
            got, pos = [], a
            for offs, sizes in flat_boxes(shape, a, b):
                box = full[tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
                assert box.reshape(-1).tolist() == list(range(pos, pos + box.numel()))  # contiguous, in order
                pos += box.numel()
                got.append(box)
            assert pos == b


def test_tp_pieces_map_to_canonical_offsets():
    from megassm.parallel.tp import Piece, ShardSpec, shard_canonical

    full = torch.arange(24.0).view(12, 2)  # [z(4) | B(4, replicated) | x(4)] along dim 0, tp = 2
    spec = ShardSpec(0, (Piece(4, 2, (0, 1)), Piece(4, 1, (0, 0)), Piece(4, 2, (0, 1))))
    for rank in (0, 1):
        local = shard_canonical(full, spec, rank)
        boxes = sharded_chunks.to_canonical((0, 0), local, spec, rank)
        assert len(boxes) == 3
        for offs, view in boxes:
            assert torch.equal(view, full[offs[0]:offs[0] + view.shape[0]])


# ----------------------------------------------------------------------------------------------------
# one process: equal to the canonical checkpoint, resume, async, interrupted writes
# ----------------------------------------------------------------------------------------------------
def _cfg(run_dir, *extra):
    return load_config(None, [*TINY, f"run.dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def inproc(tmp_path_factory):
    from megassm.training.trainer import Trainer

    base = tmp_path_factory.mktemp("sharded-inproc")
    canon = Trainer(_cfg(base / "canon")).fit()
    shard = Trainer(_cfg(base / "shard", *SHARDED, "run.async_save=true")).fit()
    return base, canon, shard


def test_sharded_single_process_equals_canonical_and_resumes_exactly(inproc):
    from megassm.training.trainer import Trainer

    base, canon, shard = inproc
    assert shard == canon  # the checkpoint format does not touch training
    a, b = _ckpt(base / "canon", 2), _ckpt(base / "shard", 2)
    ma, oa = ckpt.read_model_and_optim(a)
    mb, ob = ckpt.read_model_and_optim(b)  # the sharded checkpoint read in one process: canonical state dicts
    assert list(ma) == list(mb) and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert oa["param_groups"] == ob["param_groups"] and sorted(oa["state"]) == sorted(ob["state"])
    for i, st in oa["state"].items():
        assert list(st) == list(ob["state"][i])
        assert all(torch.equal(v, ob["state"][i][k]) and v.dtype == ob["state"][i][k].dtype for k, v in st.items())
    meta = ckpt.read_meta(b)
    assert meta["format"] == "sharded" and meta["complete"] is True
    assert set(meta["integrity"]["files"]) == set(meta["files"]) and "meta.json" not in meta["files"]
    for f, rec in meta["integrity"]["files"].items():
        assert ckpt.file_record(os.path.join(b, f)) == rec
    assert ckpt.verify_checkpoint(b) == []
    resumed = Trainer(_cfg(base / "resume", *SHARDED, f"run.resume={b}")).fit()
    assert resumed == shard[2:]  # bit for bit in one process
    # the canonical checkpoint resumes into a sharded-format run, and megassm-eval's loader reads both
    model = Trainer(_cfg(base / "x", "train.steps=1")).model
    assert ckpt.load_checkpoint(b, model=model)["step"] == 2
    assert all(torch.equal(v, ma[k]) for k, v in model.state_dict().items())


def test_async_save_returns_before_the_write_and_keeps_the_step_boundary_snapshot(tmp_path, monkeypatch):
    from megassm.training.trainer import Trainer

    gate, reached = threading.Event(), threading.Event()

    def hook(stage):
        if stage == "before_write":
            reached.set()
            assert gate.wait(60)

    monkeypatch.setattr(sharded, "_write_hook", hook)
    tr = Trainer(_cfg(tmp_path / "run", *SHARDED, "run.async_save=true", "run.keep_last=1"))
    tr.train_step()
    tr.step = 1
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    path = tr.checkpoints.save(tr.step)
    assert reached.wait(60)
    fut = tr.checkpoints.sharded.pending
    assert fut is not None and not fut.done()  # save() returned; the write has not started
    assert not os.path.exists(path) and ckpt.find_latest(str(tmp_path / "run")) is None
    with torch.no_grad():  # training goes on: the checkpoint keeps the step-boundary values
        for p in tr.model.parameters():
            p.add_(1.0)
    gate.set()
    tr.checkpoints.sharded.wait()
    assert ckpt.is_complete(path)
    m, _ = ckpt.read_model_and_optim(path)
    assert all(torch.equal(m[k], before[k]) for k in before)


def test_interrupted_async_write_never_looks_complete_and_is_not_pruned(tmp_path, monkeypatch):
    from megassm.training.trainer import Trainer

    run = tmp_path / "run"
    tr = Trainer(_cfg(run, *SHARDED, "run.async_save=true", "run.keep_last=1"))
    tr.train_step()
    tr.step = 1
    first = tr.checkpoints.save(tr.step)
    tr.checkpoints.sharded.wait()
    assert ckpt.find_latest(str(run)) == first

    gate = threading.Event()

    def hook(stage):
        if stage == "before_finalize":  # every rank's DCP files are written, meta.json is not
            assert gate.wait(60)
            raise OSError("disk full (simulated)")

    monkeypatch.setattr(sharded, "_write_hook", hook)
    tr.train_step()
    tr.step = 2
    second = tr.checkpoints.save(tr.step)
    root = os.path.join(run, "checkpoints")
    tmp = [d for d in os.listdir(root) if d.startswith(".tmp-step_00000002-")]
    assert len(tmp) == 1
    ckpt.prune(str(run), 1, first)  # keep_last: only complete checkpoints are candidates
    assert os.path.isdir(os.path.join(root, tmp[0])) and ckpt.find_latest(str(run)) == first
    gate.set()
    with pytest.raises(ckpt.CheckpointWriteError, match="step_00000002: disk full .*partial checkpoint was removed"):
        tr.checkpoints.sharded.wait()
    assert not os.path.exists(second) and ckpt.find_latest(str(run)) == first
    assert not os.path.exists(os.path.join(root, tmp[0]))  # the failed write removed its temp directory


def test_config_refusals():
    with pytest.raises(ConfigError, match="run.checkpoint_format must be canonical or sharded"):
        load_config(None, [*TINY, "run.checkpoint_format=dcp"])
    with pytest.raises(ConfigError, match="run.async_save=true needs run.checkpoint_format=sharded"):
        load_config(None, [*TINY, "run.async_save=true"])


# ----------------------------------------------------------------------------------------------------
# megassm-checkpoint convert
# ----------------------------------------------------------------------------------------------------
def _load_both(path):
    m, o = ckpt.read_model_and_optim(path)
    return m, o


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_convert_round_trip_is_bit_identical(inproc, tmp_path):
    from megassm.checkpoint_cli import main

    base, _, _ = inproc
    src = _ckpt(base / "canon", 4)
    mid, back = tmp_path / "sharded", tmp_path / "canonical"
    assert main(["convert", "--input", src, "--output", str(mid), "--to", "sharded"]) == 0
    assert sharded.checkpoint_format(str(mid)) == "sharded" and ckpt.is_complete(str(mid))
    assert main(["convert", "--input", str(mid), "--output", str(back), "--to", "canonical"]) == 0
    for name in ("model.pt", "optim.pt"):
        a = torch.load(os.path.join(src, name), weights_only=True)
        b = torch.load(back / name, weights_only=True)
        assert _same(a, b), name
    meta_a, meta_b = ckpt.read_meta(src), ckpt.read_meta(str(back))
    for key in meta_a["extra_files"]:
        assert open(os.path.join(src, f"{key}.pt"), "rb").read() == (back / f"{key}.pt").read_bytes()
    for key in ("step", "consumed_tokens", "config_hash", "extra_files"):
        assert meta_a[key] == meta_b[key]
    # the converted sharded checkpoint resumes like the original
    assert _same(_load_both(src), _load_both(str(mid)))


def test_convert_refusals_name_the_path_and_leave_nothing(inproc, tmp_path, capsys):
    from megassm.checkpoint_cli import main

    base, _, _ = inproc
    src = _ckpt(base / "canon", 4)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    meta = json.loads((broken / "meta.json").read_text())
    meta["complete"] = False
    (broken / "meta.json").write_text(json.dumps(meta))
    exists = tmp_path / "exists"
    exists.mkdir()
    cases = [
        ([str(tmp_path / "nope"), str(tmp_path / "o1"), "sharded"], "not a directory", tmp_path / "nope"),
        ([str(tmp_path), str(tmp_path / "o2"), "sharded"], "not a checkpoint", tmp_path),
        ([str(broken), str(tmp_path / "o3"), "sharded"], "incomplete", broken),
        ([src, str(tmp_path / "o4"), "canonical"], "already in the canonical format", src),
        ([src, str(exists), "sharded"], "output exists", exists),
    ]
    for (i, o, to), word, named in cases:
        assert main(["convert", "--input", i, "--output", o, "--to", to]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and word in err and str(named) in err, err
    left = sorted(p for p in os.listdir(tmp_path) if p not in ("broken", "exists"))
    assert left == [], left


# ----------------------------------------------------------------------------------------------------
# several processes (torchrun, gloo): save at DP 2, resume at DP 1 / TP 2 / PP 2
# ----------------------------------------------------------------------------------------------------
# the distributed optimizer with 10 buckets: each rank owns slice r of every bucket
DISTOPT = ["parallel.engine=ddp", "parallel.zero_stage=1", "parallel.bucket_mb=0.02"]
ENGINES = {"ddp": ["parallel.engine=ddp"], "fsdp2": ["parallel.engine=fsdp2"], "distopt": DISTOPT}


_run = partial(train_losses, base=TINY)


@pytest.mark.parametrize("name,resumes", [
    ("ddp", [(1, []), (2, ["parallel.tp=2"])]),
    ("fsdp2", [(1, []), (2, ["parallel.tp=2"]), (4, DISTOPT)]),
    ("distopt", [(2, ["parallel.pp=2"]), (2, ["parallel.engine=ddp"]), (2, ["parallel.engine=fsdp2"])]),
])
def test_dp2_sharded_checkpoint_resumes_in_other_layouts(name, resumes, tmp_path):
    """Saved (async) at DP 2 by the engine; the step-2 checkpoint resumed at DP 1 (one process), TP 2, PP 2, under
    another engine (the distributed optimizer's slices of every bucket -> plain DDP / FSDP2, FSDP2 -> the
    distributed optimizer at DP 4) continues the uninterrupted DP-2 run's losses (fp32 rounding: the reductions
    differ by layout), and so does
    its canonical conversion (megassm-checkpoint) resumed in one process: the layout records the single-device
    optimizer's groups and order (FSDP2's optimizer splits each group in two)."""
    from megassm.checkpoint_cli import main

    run_dir = tmp_path / name
    straight = _run(run_dir, nproc=2, extra=ENGINES[name] + SHARDED + ["run.async_save=true"])
    path = _ckpt(run_dir, 2)
    meta = ckpt.read_meta(path)
    assert meta["format"] == "sharded" and meta["world_size"] == 2
    written = {f: meta["integrity"]["files"][f]["bytes"] for f in meta["files"] if f.startswith("dcp/__")}
    assert sorted({f.split("_")[2] for f in written}) == ["0", "1"]  # both ranks wrote
    assert min(written.values()) > 0.3 * max(written.values())  # the work is spread, not all on rank 0
    for nproc, layout in resumes:
        resumed = _run(tmp_path / f"r{nproc}{'-'.join(layout)}", nproc=nproc, extra=layout + SHARDED, resume=path)
        assert _close(resumed, {s: straight[s] for s in (3, 4)}), (name, layout, resumed, straight)
    canonical = tmp_path / "canonical"
    assert main(["convert", "--input", path, "--output", str(canonical), "--to", "canonical"]) == 0
    groups = [len(g["params"]) for g in torch.load(canonical / "optim.pt", weights_only=True)["param_groups"]]
    assert len(groups) == 2, groups  # weight decay and none, as the single-device optimizer has them
    resumed = _run(tmp_path / "r-canonical", resume=canonical)
    assert _close(resumed, {s: straight[s] for s in (3, 4)}), (name, resumed, straight)


def test_fsdp2_tp2_sharded_checkpoint_resumes_and_converts(tmp_path):
    """TP 2 x FSDP2 over DP 2 with SP (4 ranks) saves (async) sharded checkpoints: every rank writes its DP shard of
    its TP-local tensors as chunks of the canonical ones. The step-2 checkpoint resumed at the same layout continues
    the uninterrupted run's losses; converted to canonical (megassm-checkpoint) it resumes in one process."""
    from megassm.checkpoint_cli import main

    layout = ["parallel.engine=fsdp2", "parallel.tp=2", "parallel.sp=true"]
    straight = _run(tmp_path / "straight", nproc=4, extra=layout + SHARDED + ["run.async_save=true"])
    path = _ckpt(tmp_path / "straight", 2)
    meta = ckpt.read_meta(path)
    assert meta["format"] == "sharded" and meta["world_size"] == 4
    written = {f.split("_")[2] for f in meta["files"] if f.startswith("dcp/__")}
    assert sorted(written) == ["0", "1", "2", "3"], written  # every rank wrote its pieces
    resumed = _run(tmp_path / "resumed", nproc=4, extra=layout + SHARDED, resume=path)
    assert _close(resumed, {s: straight[s] for s in (3, 4)}), (resumed, straight)
    canonical = tmp_path / "canonical"
    assert main(["convert", "--input", path, "--output", str(canonical), "--to", "canonical"]) == 0
    one = _run(tmp_path / "one", resume=canonical)
    assert _close(one, {s: straight[s] for s in (3, 4)}), (one, straight)


def test_distopt_pp2_sharded_checkpoint_resumes_in_one_process(tmp_path):
    """PP 2 x the distributed optimizer over DP 2 (4 ranks) saves sharded checkpoints: each stage's ranks write the
    AdamW pieces they own of its buckets (the last stage's copy of the tied embedding none: the first stage's are
    the canonical tensor's). Resumed in one process, the step-2 checkpoint continues the uninterrupted run's
    losses."""
    straight = _run(tmp_path / "straight", nproc=4, extra=DISTOPT + ["parallel.pp=2"] + SHARDED)
    one = _run(tmp_path / "one", extra=SHARDED, resume=_ckpt(tmp_path / "straight", 2))
    assert _close(one, {s: straight[s] for s in (3, 4)}), (one, straight)
