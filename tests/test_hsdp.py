"""HSDP (`parallel.engine=fsdp2 parallel.shard_size=N`: FSDP2 sharding inside groups of N data-parallel ranks,
replicas across them) and FSDP2's once-per-step gradient sync (`parallel.fsdp_grad_sync=step`), over gloo with
real processes standing in for nodes:
- each layout (HSDP 2 x 2, HSDP with TP 2 + SP as replicate x shard x tp on 8 ranks, FSDP2 and HSDP with the
  step sync) equals one process over the same global batch: losses, gradient norms (clipping binds), validation
  losses, the canonical weights and AdamW moments;
- the collectives actually issued (counted in the ranks): the replica all-reduce once per optimizer step, the
  reduce-scatter once per micro-batch or once per step, and their bytes equal what the dry run prints
  (training/traffic.py);
- a sharded checkpoint saved under HSDP resumes under FSDP2, DDP and in one process with the same losses;
- impossible shapes are refused with named errors before any model is built."""
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

from megassm.config import ConfigError, load_config

from compare import close
from multiproc import losses, spawn, train_losses, train_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=64", "model.mamba.d_state=16",
    "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.attn.n_heads=4", "model.attn.n_kv_heads=2",
    "model.mlp.ffn_hidden=128", "train.seq_len=40", "train.micro_batch=2", "train.global_batch=16",
    "train.log_interval=1", "optim.warmup_steps=2", "optim.lr=3e-3", "train.grad_clip=0.5",
    "train.eval_interval=2", "train.eval_tokens=640", "run.progress=false", "run.tensorboard=false",
    "train.steps=4", "run.save_interval=2", "train.device=cpu",
]
HSDP = ["parallel.engine=fsdp2", "parallel.shard_size=2"]
LAYOUTS = {  # name: (ranks, overrides); 16 sequences a step: 8 micro-batches in one process
    "hsdp_2x2": (4, HSDP),  # 2 micro-batches per rank
    "hsdp_2x2_step_sync": (4, HSDP + ["parallel.fsdp_grad_sync=step", "parallel.fsdp_reshard=block"]),
    "fsdp2_step_sync": (2, ["parallel.engine=fsdp2", "parallel.fsdp_grad_sync=step"]),  # 4 micro-batches per rank
    # 8 ranks: replicate 2 x shard 2 x TP 2 (TP fastest), SP, the model's B/C TP-replicated (ngroups 1)
    "hsdp_2x2_tp2_sp": (8, HSDP + ["parallel.tp=2", "parallel.sp=true"]),
}

_records = partial(train_records, base=TINY, timeout=400)


def _ckpt(run_dir, step):
    return os.path.join(run_dir, "checkpoints", f"step_{step:08d}")


def _same(a: dict, b: dict, rel: float = 2e-5) -> bool:
    return sorted(a) == sorted(b) and all(close(a[s], b[s], rel) for s in b)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("hsdp") / "single"
    return d, _records(d)


def _same_checkpoints(a_dir, b_dir, step: int, tol: float = 1e-4) -> None:
    for fname in ("model.pt", "optim.pt"):
        a = torch.load(os.path.join(_ckpt(a_dir, step), fname))
        b = torch.load(os.path.join(_ckpt(b_dir, step), fname))
        if fname == "optim.pt":
            assert a["param_groups"] == b["param_groups"]
            a = {f"{i}.{k}": v for i, st in a["state"].items() for k, v in st.items()}
            b = {f"{i}.{k}": v for i, st in b["state"].items() for k, v in st.items()}
        assert sorted(a) == sorted(b)
        for k in b:
            scale = float(b[k].float().abs().max().clamp(min=1e-12))
            err = float((a[k].float() - b[k].float()).abs().max()) / scale
            assert err <= tol, (fname, k, err)  # NaN fails too


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_single_process(name, single, tmp_path):
    ref_dir, ref = single
    nproc, extra = LAYOUTS[name]
    got = _records(tmp_path / name, nproc=nproc, extra=extra)
    assert _same(losses(got), losses(ref)), (name, losses(got), losses(ref))
    norms, ref_norms = losses(got, "grad_norm"), losses(ref, "grad_norm")
    assert min(ref_norms.values()) > 2 * 0.5, ref_norms  # the clip binds every step
    assert _same(norms, ref_norms), (name, norms, ref_norms)
    val, ref_val = losses(got, "loss_val"), losses(ref, "loss_val")
    assert sorted(ref_val) == [2, 4] and _same(val, ref_val), (name, val, ref_val)
    # TP 2 + SP over 8 ranks sums in other orders: the same layout under DDP is 2.1e-4 off one process in the
    # weights after 4 AdamW steps (its worst, out_proj; AdamW turns tiny gradients' rounding into whole steps)
    _same_checkpoints(tmp_path / name, ref_dir, 4, tol=5e-4 if "tp2" in name else 1e-4)


# ----------------------------------------------------------------------------------------------------
# the collectives the ranks issue, counted, against training/traffic.py
# ----------------------------------------------------------------------------------------------------
COUNTED = {
    "hsdp_2x2": HSDP,
    "hsdp_2x2_step_sync": HSDP + ["parallel.fsdp_grad_sync=step"],
    "fsdp2_dp4_step_sync": ["parallel.engine=fsdp2", "parallel.fsdp_grad_sync=step"],
}


def _count_worker(rank, world, run_root):
    """Each layout's trainer in this process, two steps of 2 micro-batches, every all-reduce / reduce-scatter /
    all-gather of the steps recorded as (op, group ranks, bytes of the full buffer)."""
    import torch.distributed as dist

    from megassm.training import traffic
    from megassm.training.trainer import Trainer

    calls = []

    def counting(op, fn, size_of):
        def wrapped(*args, **kwargs):
            if recording[0]:
                group = kwargs.get("group")
                ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world))
                calls.append((op, ranks, size_of(*args, **kwargs)))
            return fn(*args, **kwargs)
        return wrapped

    def nbytes(t):
        return t.numel() * t.element_size()

    recording = [False]
    dist.all_reduce = counting("all_reduce", dist.all_reduce, lambda t, *a, **k: nbytes(t))
    dist.reduce_scatter_single = counting("reduce_scatter", dist.reduce_scatter_single,
                                          lambda *a, **k: nbytes(k.get("input", a[1] if len(a) > 1 else None)))
    dist.all_gather_single = counting("all_gather", dist.all_gather_single, lambda out, *a, **k: nbytes(out))
    out = {}
    for name, layout in COUNTED.items():
        cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), [*TINY, *layout, "train.steps=2", "train.eval_interval=0",
                                                "run.save_final=false", "run.save_interval=0",
                                                "train.global_batch=16", f"run.dir={run_root}/{name}"])
        trainer = Trainer(cfg)
        step = trainer.train_step

        def recorded_step():
            recording[0] = True
            try:
                return step()
            finally:
                recording[0] = False

        trainer.train_step = recorded_step
        calls.clear()
        trainer.fit()
        trainer.close()
        flows = [f for f in traffic.step_flows(cfg, bf16=trainer.amp_dtype is not None)
                 if f.group in ("shard", "replicate", "dp")]
        out[name] = {"calls": list(calls), "flows": [(f.kind, f.group, f.buffer, f.calls, f.n) for f in flows],
                     "units": sum(1 for _ in trainer.engine.units)}
    return out


def test_collectives_once_per_step_and_bytes_as_printed(tmp_path):
    results = spawn(_count_worker, 4, str(tmp_path), timeout=400)
    for name in COUNTED:
        r = results[0][name]  # rank 0: its shard group is ranks (0, 1) under HSDP, its replicas (0, 2)
        steps, units = 2, r["units"]
        by = {}
        for op, ranks, size in r["calls"]:
            n, b = by.get((op, ranks), (0, 0))
            by[(op, ranks)] = (n + 1, b + size)
        micro = 16 // (2 * 4)  # micro-batches per rank and step
        shard = (0, 1) if name.startswith("hsdp") else (0, 1, 2, 3)
        groups = {"shard": shard, "replicate": (0, 2), "dp": (0, 1, 2, 3)}
        sync_every = 1 if "step_sync" in name else micro
        assert by[("reduce_scatter", shard)][0] == steps * sync_every * units, (name, by)  # per unit and sync
        if name.startswith("hsdp"):  # the replicas meet once per step, whatever the micro-batches
            assert by[("all_reduce", (0, 2))][0] == steps * units, (name, by)
        # the bytes the dry run prints (per step), against what was sent; the other all-reduces on these groups
        # are the scalars of the clipping norm (4 bytes each)
        for kind, group, buffer, calls_per_step, n in r["flows"]:
            calls, got = by[(kind, groups[group])]
            scalars = 0 if kind != "all_reduce" else 4 * (calls - (steps * units if group == "replicate" else steps))
            assert got - scalars == buffer * calls_per_step * steps, (name, kind, group, got, buffer, calls_per_step)


# ----------------------------------------------------------------------------------------------------
# checkpoints stay layout-free
# ----------------------------------------------------------------------------------------------------
SHARDED = ["run.checkpoint_format=sharded", "train.eval_interval=0"]
_losses = partial(train_losses, base=TINY, timeout=400)


def test_hsdp_sharded_checkpoint_resumes_under_fsdp2_ddp_and_one_process(tmp_path):
    from megassm.training import checkpoint as ckpt

    straight = _losses(tmp_path / "hsdp", nproc=4, extra=HSDP + SHARDED + ["run.async_save=true"])
    path = _ckpt(tmp_path / "hsdp", 2)
    meta = ckpt.read_meta(path)
    assert meta["format"] == "sharded" and meta["world_size"] == 4
    written = {f.split("_")[2] for f in meta["files"] if f.startswith("dcp/__")}
    assert sorted(written) == ["0", "1", "2", "3"], written  # the replicas share the writing
    for nproc, layout in ((2, ["parallel.engine=fsdp2"]), (2, ["parallel.engine=ddp"]), (1, [])):
        resumed = _losses(tmp_path / f"r{nproc}{'-'.join(layout)}", nproc=nproc, extra=layout + SHARDED, resume=path)
        assert _same(resumed, {s: straight[s] for s in (3, 4)}), (layout, resumed, straight)


# ----------------------------------------------------------------------------------------------------
# refusals and the dry run
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("over,word", [
    (["parallel.engine=fsdp2", "parallel.shard_size=3"], "parallel.shard_size=3 must divide the 4 data-parallel"),
    (["parallel.engine=fsdp2", "parallel.shard_size=8"], "parallel.shard_size=8 must divide"),
    (["parallel.shard_size=2"], "parallel.shard_size=2 needs parallel.engine=fsdp2"),
    (["parallel.fsdp_grad_sync=step"], "parallel.fsdp_grad_sync=step needs parallel.engine=fsdp2"),
    (["parallel.engine=fsdp2", "parallel.fsdp_grad_sync=always"], "parallel.fsdp_grad_sync must be micro_batch or step"),
    (["parallel.gpus_per_node=3"], "parallel.gpus_per_node=3 must divide the world size 4"),
    (["parallel.engine=fsdp2", "parallel.shard_size=-1"], "parallel.shard_size must be >= 0"),
])
def test_impossible_shapes_are_named(over, word):
    with pytest.raises(ConfigError, match=word.replace(".", r"\.")):
        load_config(os.path.join(ROOT, "configs/tiny.yaml"), ["parallel.world_size=4", "train.micro_batch=1", "train.global_batch=4", *over])


def test_dry_run_prints_hsdp_memory_and_traffic():
    """The 4-node recipe as HSDP: the table names the shard x replicate layout, the traffic lines put the
    reduce-scatters inside the nodes and only the replica all-reduce across them; FSDP2 over all 32 ranks sends
    every micro-batch's reduce-scatter across."""
    def dry(*over):
        r = subprocess.run([sys.executable, "-m", "megassm.train", "--config", "configs/recipes/hybrid-7b-4node.yaml",
                            "--dry-run", "parallel.gpus_per_node=8", *over], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout

    hsdp = dry("parallel.shard_size=8")
    assert "(HSDP: shard 8 x replicate 4)" in hsdp
    assert "HSDP replica all-reduce of the gradient shards (fp32): replicate group of 4 (4 nodes)" in hsdp
    assert "FSDP2 gradient reduce-scatter (fp32): shard group of 8 (1 node)" in hsdp
    flat = dry("parallel.shard_size=0")
    assert "FSDP2 gradient reduce-scatter (fp32): shard group of 32 (4 nodes)" in flat
    hint = "parallel.shard_size=8 (HSDP) keeps them inside a node"
    assert hint in flat and hint not in hsdp  # the dry run points at HSDP where FSDP2 crosses every micro-batch
    assert "straddles nodes of 8" in dry("parallel.world_size=24", "parallel.shard_size=12", "train.global_batch=48")

    def across(text):
        line = next(x for x in text.splitlines() if x.startswith("# traffic per GPU per optimizer step"))
        return float(line.split("across nodes ")[1].split(" GB")[0])

    assert across(hsdp) < across(flat) / 4, (across(hsdp), across(flat))


def test_traffic_formulas_for_the_data_parallel_engines():
    """training/traffic.py on paper, 4 nodes of 8: the distributed optimizer sends exactly a DDP all-reduce's bytes
    (parallel/distopt.py's own count), 1/8 of them across nodes (a ring over 4 nodes of 8 crosses on 4 of 32
    links); HSDP's replica all-reduce crosses whole; a pipeline send to the next node crosses whole."""
    from megassm.parallel.distopt import distopt_bytes_per_step
    from megassm.training import traffic

    def flows(*over):
        cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"),
                          ["parallel.world_size=32", "parallel.gpus_per_node=8", "train.micro_batch=1",
                           "train.global_batch=64", *over])
        return cfg, traffic.step_flows(cfg, bf16=False)

    _, ddp = flows("parallel.engine=ddp")
    _, dist_opt = flows("parallel.engine=ddp", "parallel.zero_stage=1")
    (ar,) = ddp
    assert ar.n == 32 and ar.nodes == 4 and ar.calls == 1
    n_local = ar.buffer / 4
    assert sum(f.sent for f in dist_opt) == ar.sent == distopt_bytes_per_step(int(n_local), 32)
    assert sum(f.across for f in dist_opt) == ar.across == ar.sent * 4 / 32
    cfg, hsdp = flows("parallel.engine=fsdp2", "parallel.shard_size=8")
    rep = next(f for f in hsdp if f.group == "replicate")
    assert rep.n == 4 and rep.nodes == 4 and rep.across == rep.sent == 2 * 3 / 4 * rep.buffer
    assert all(f.across == 0 for f in hsdp if f.group == "shard")
    rs = next(f for f in hsdp if f.kind == "reduce_scatter")
    assert rs.calls == 2  # 64 / (1 x 32) micro-batches a step, one reduce-scatter each
    _, pp = flows("parallel.pp=4", "parallel.engine=ddp")  # stride 8 ranks: each stage on its own node
    sends = [f for f in pp if f.kind == "p2p"]
    assert sends and all(f.across == f.sent for f in sends)
    assert traffic.totals(pp)["across"] > 0
