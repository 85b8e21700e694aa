"""The cross-checks that can fail before any compute (`validate`): counts first, then the pattern, each block kind's
own checks (models/registry.py), the batch triad, the parallel layout, the run directory."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from .sections import Config, ConfigError, PATTERN_SEPARATORS, block_letters
from .derived import blocks_of, ffn_hidden, world_size


# count keys with their smallest value, checked before every other check (None: unset is fine). The other
# counts have their own checks below or in their block kind's (models/registry.py); tests/test_config_values.py
# tries 0 and -1 on every integer key.
_COUNTS_FIRST = {
    "model.d_model": 1, "model.mamba.d_state": 1, "model.mamba.expand": 1, "model.mamba.headdim": 1,
    "model.mamba.ngroups": 1, "model.mamba.chunk_size": 1, "model.attn.n_heads": 1, "model.attn.n_kv_heads": 1,
    "model.attn.head_dim": 1, "model.mlp.ffn_hidden": 1,
    "train.steps": 1, "train.seq_len": 1, "train.micro_batch": 1, "train.global_batch": 1, "train.log_interval": 1,
    "parallel.tp": 1, "parallel.cp": 1, "parallel.pp": 1, "parallel.pp_virtual": 1, "parallel.world_size": 1,
    "kernels.ssd_dbc_split": 1,  # its values (1, 2, 4, 8) are checked with the other kernels.* (run_config.py)
}
# a float that may be infinite: the upper clamp of dt (mamba_ssm's "no clamp" is (0, inf)); NaN never
_MAY_BE_INF = {"model.mamba.dt_limit[1]"}


def _section(cfg: Config, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _float_values(obj: Any, prefix: str = ""):
    """(dotted key, value) of every float in the config, list items as key[i]."""
    for f in dataclasses.fields(obj):
        v, key = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(v):
            yield from _float_values(v, key + ".")
        elif isinstance(v, float):
            yield key, v
        elif isinstance(v, list):
            yield from ((f"{key}[{i}]", x) for i, x in enumerate(v) if isinstance(x, float))


def in_run_dir(path: str, run_dir: str) -> bool:
    """Whether a run.resume path names run_dir's own checkpoints: run_dir itself, its checkpoints folder or a
    checkpoint in it (not a run moved aside into run_dir/previous-*)."""
    path, run_dir = (os.path.abspath(os.path.expanduser(x)).rstrip(os.sep) for x in (path, run_dir))
    own = os.path.join(run_dir, "checkpoints")
    return path in (run_dir, own) or path.startswith(own + os.sep)


def validate(cfg: Config) -> None:
    """Every cross-check that can fail before compute. Raises ConfigError naming the keys."""
    m, t, o, p = cfg.model, cfg.train, cfg.optim, cfg.parallel

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    # the counts the checks below divide by or build sizes from: refused first, so a zero is named, not met as a
    # ZeroDivisionError (or, for train.global_batch, only after run.dir was created)
    for key, low in _COUNTS_FIRST.items():
        section, name = key.rsplit(".", 1)
        v = getattr(_section(cfg, section), name)
        need(v is None or v >= low, f"{key} must be {'positive' if low == 1 else f'>= {low}'}, got {v}")

    # pattern
    from megassm.models.registry import block_kind

    known = block_letters()
    need(len(blocks_of(m.pattern)) > 0, f"model.pattern: '{m.pattern}' has no blocks")
    for i, c in enumerate(m.pattern):
        need(
            c in known or c in PATTERN_SEPARATORS,
            f"model.pattern: unknown letter '{c}' at position {i} of '{m.pattern}' "
            f"(known: {', '.join(f'{k} {v}' for k, v in known.items())}, | stage boundary)",
        )
    need(m.d_model > 0, f"model.d_model must be positive, got {m.d_model}")
    need(m.pad_vocab_multiple > 0, f"model.pad_vocab_multiple must be positive, got {m.pad_vocab_multiple}")
    need(m.vocab_size is None or m.vocab_size > 0, f"model.vocab_size must be positive, got {m.vocab_size}")
    letters = set(blocks_of(m.pattern))
    kinds = [block_kind(c) for c in known if c in letters]  # registry order

    for kind in kinds:  # each kind's own sections (model.mamba.*, model.attn.*, ...)
        if kind.check is not None:
            kind.check(cfg, need)
    for kind in kinds:
        c, name = kind.letter, kind.name
        need(p.cp == 1 or kind.cp is not None,
             f"parallel.cp={p.cp}: context parallelism has no plan for {name} (`{c}` in model.pattern): "
             "its state hand-off between ranks is not built (docs/seeds.md)")
        need(not t.bptt or kind.bptt is not None,
             f"train.bptt=true with {name} (`{c}` in model.pattern): the BPTT carrier "
             "(training/bptt.py) does not carry its state yet; its state object and step() support it "
             "(docs/seeds.md)")

    # training
    need(t.steps > 0, f"train.steps must be positive, got {t.steps}")
    need(t.seq_len > 0, f"train.seq_len must be positive, got {t.seq_len}")
    need(t.micro_batch > 0, f"train.micro_batch must be positive, got {t.micro_batch}")
    need(t.precision in ("auto", "bf16", "fp32"), f"train.precision must be auto, bf16 or fp32, got '{t.precision}'")
    need(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, got '{t.device}'")
    need(t.eval_interval >= 0 and t.eval_tokens >= 0,
         f"train.eval_interval and train.eval_tokens must be >= 0, got {t.eval_interval} and {t.eval_tokens}")
    need(t.log_interval > 0, "train.log_interval must be positive")
    need(t.spike_action in ("off", "skip", "rollback"),
         f"train.spike_action must be off, skip or rollback, got '{t.spike_action}'")
    need(t.spike_window >= 2,
         f"train.spike_window must be >= 2 (a standard deviation needs two steps), got {t.spike_window}")
    need(0 < t.spike_sigma < float("inf"), f"train.spike_sigma must be a finite number > 0, got {t.spike_sigma}")
    need(t.spike_min_steps is None or 2 <= t.spike_min_steps <= t.spike_window,
         f"train.spike_min_steps must be in [2, train.spike_window={t.spike_window}], got {t.spike_min_steps}")
    need(t.spike_max_rollbacks >= 0, f"train.spike_max_rollbacks must be >= 0, got {t.spike_max_rollbacks}")
    need(t.spike_action != "rollback" or cfg.run.save_interval > 0,
         "train.spike_action=rollback needs run.save_interval > 0 (the checkpoints it rolls back to)")
    need(t.straggler_interval is None or t.straggler_interval >= 0,
         f"train.straggler_interval must be >= 0 (0: off; unset: train.log_interval), got {t.straggler_interval}")
    need(0 < t.straggler_fraction < float("inf"),
         f"train.straggler_fraction must be a finite number > 0, got {t.straggler_fraction}")
    need(t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 disables clipping), got {t.grad_clip}")
    need(t.bptt_windows >= 1, f"train.bptt_windows must be >= 1, got {t.bptt_windows}")
    need(t.loss_chunk_tokens >= 0, f"train.loss_chunk_tokens must be >= 0 (0: no chunking), got {t.loss_chunk_tokens}")
    need(t.activation_checkpointing_blocks >= 0,
         f"train.activation_checkpointing_blocks must be >= 0 (0: every block), got {t.activation_checkpointing_blocks}")
    need(not t.activation_checkpointing_blocks or t.activation_checkpointing,
         f"train.activation_checkpointing_blocks={t.activation_checkpointing_blocks} needs "
         "train.activation_checkpointing=true (it says how many blocks recompute)")
    need(t.activation_checkpointing_keep in ("pair", "sum"),
         f"train.activation_checkpointing_keep must be pair or sum, got '{t.activation_checkpointing_keep}'")
    need(t.activation_checkpointing_keep == "pair" or t.activation_checkpointing,
         f"train.activation_checkpointing_keep={t.activation_checkpointing_keep} needs "
         "train.activation_checkpointing=true (it says what each checkpointed block keeps)")
    n_blocks = len(blocks_of(m.pattern))
    need(t.activation_checkpointing_blocks <= n_blocks,
         f"train.activation_checkpointing_blocks={t.activation_checkpointing_blocks} is more than the model's "
         f"{n_blocks} blocks (model.pattern)")

    # optimizer
    need(o.lr > 0, f"optim.lr must be positive, got {o.lr}")
    need(0 <= o.min_lr <= o.lr, f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}]")
    need(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    need(o.decay in ("cosine", "linear", "constant"), f"optim.decay must be cosine, linear or constant, got '{o.decay}'")
    need(o.fused in ("auto", "true", "false"), f"optim.fused must be auto, true or false, got '{o.fused}'")
    need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1,
         f"optim.beta1 and optim.beta2 must be in [0, 1), got {o.beta1} and {o.beta2}")
    need(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    need(o.eps > 0, f"optim.eps must be positive (it keeps AdamW's update finite where a gradient is 0), got {o.eps}")
    need(m.norm_eps > 0, f"model.norm_eps must be positive, got {m.norm_eps}")
    need(m.init_std >= 0, f"model.init_std must be >= 0, got {m.init_std}")
    need(m.attn.rope_theta > 0, f"model.attn.rope_theta must be positive, got {m.attn.rope_theta}")
    need(m.mamba.dt_init_floor >= 0, f"model.mamba.dt_init_floor must be >= 0, got {m.mamba.dt_init_floor}")

    # checkpoints
    r = cfg.run
    need(r.checkpoint_format in ("canonical", "sharded"),
         f"run.checkpoint_format must be canonical or sharded, got '{r.checkpoint_format}'")
    need(not r.async_save or r.checkpoint_format == "sharded",
         "run.async_save=true needs run.checkpoint_format=sharded (the canonical format gathers to rank 0 and "
         "writes synchronously)")
    need(r.keep_last >= 0, f"run.keep_last must be >= 0 (0 keeps all), got {r.keep_last}")
    need(r.wandb in ("off", "online", "offline"), f"run.wandb must be off, online or offline, got '{r.wandb}'")
    need(r.wandb == "off" or bool(r.wandb_project.strip()), "run.wandb_project must not be empty with run.wandb on")
    need(r.save_interval >= 0, f"run.save_interval must be >= 0 (0: only at the end), got {r.save_interval}")
    resume = str(r.resume).strip()
    need(not r.overwrite or resume.lower() != "auto",
         "run.overwrite=true starts a new run (the earlier one in run.dir moved aside) and run.resume=auto continues "
         "the earlier one: set only one of them")
    need(not r.overwrite or resume.lower() in ("", "none", "auto") or not in_run_dir(resume, r.dir),
         f"run.overwrite=true would move run.resume={resume} aside with the earlier run in run.dir={r.dir}: resume "
         "it without run.overwrite, or copy it out of run.dir first")

    # data
    d = cfg.data
    need(d.builtin is not None or len(d.paths) > 0,
         "data: set data.paths (shard prefixes from megassm-preprocess) or data.builtin (e.g. stdlib)")
    need(d.builtin in (None, "stdlib"), f"data.builtin must be 'stdlib' or unset, got '{d.builtin}'")
    need(d.builtin is None or not d.paths,
         f"data.builtin={d.builtin} and data.paths are both set: pass data.builtin=none to train on data.paths "
         "(or drop data.paths to train on the built-in corpus)")
    need(d.weights is None or len(d.weights) == len(d.paths),
         f"data.weights has {0 if d.weights is None else len(d.weights)} entries but data.paths has {len(d.paths)}")
    need(len(d.split) == 3 and all(x >= 0 for x in d.split) and d.split[0] > 0,
         f"data.split must be three non-negative numbers train,valid,test with train > 0, got {d.split}")
    need(d.weights is None or (all(w >= 0 for w in d.weights) and sum(d.weights) > 0),
         f"data.weights must be non-negative numbers with a positive sum, got {d.weights}")
    need(d.prefetch >= 0, f"data.prefetch must be >= 0 (0: synchronous), got {d.prefetch}")

    # parallel layout and the batch triad
    for k in ("tp", "cp", "pp"):
        need(getattr(p, k) >= 1, f"parallel.{k} must be >= 1")
    need(not p.sp or t.seq_len % (p.tp * p.cp) == 0,
         f"parallel.sp=true: train.seq_len={t.seq_len} must be divisible by parallel.tp={p.tp}"
         + (f" x parallel.cp={p.cp}" if p.cp > 1 else "") + " (sequence shards)")
    need(t.seq_len % p.cp == 0,
         f"parallel.cp={p.cp}: train.seq_len={t.seq_len} must be divisible by parallel.cp (each rank holds one "
         "contiguous slice of every sequence)")
    for kind in kinds:  # the kinds' checks against the layout (e.g. the Mamba-2 conv halo under CP)
        if kind.check_layout is not None:
            kind.check_layout(cfg, need)
    need(m.vocab_size is None or (-(-m.vocab_size // m.pad_vocab_multiple) * m.pad_vocab_multiple) % p.tp == 0,
         f"parallel.tp={p.tp} must divide the padded vocabulary (model.vocab_size rounded up to "
         f"model.pad_vocab_multiple={m.pad_vocab_multiple})")
    need(p.engine in ("ddp", "fsdp2", "deepspeed"), f"parallel.engine must be ddp, fsdp2 or deepspeed, got '{p.engine}'")
    need(p.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage must be 0..3, got {p.zero_stage}")
    need(p.bucket_mb > 0, f"parallel.bucket_mb must be > 0, got {p.bucket_mb}")
    need(p.fsdp_param_dtype in ("auto", "bf16", "fp32"),
         f"parallel.fsdp_param_dtype must be auto, bf16 or fp32, got '{p.fsdp_param_dtype}'")
    need(p.fsdp_reduce_dtype in ("fp32", "bf16"), f"parallel.fsdp_reduce_dtype must be fp32 or bf16, got '{p.fsdp_reduce_dtype}'")
    need(cfg.run.profile_step >= 0, f"run.profile_step must be >= 0, got {cfg.run.profile_step}")
    need(p.fsdp_reshard in ("block", "micro_batch", "step"),
         f"parallel.fsdp_reshard must be block, micro_batch or step, got '{p.fsdp_reshard}'")
    need(p.fsdp_prefetch >= 0, f"parallel.fsdp_prefetch must be >= 0, got {p.fsdp_prefetch}")
    need(p.fsdp_grad_sync in ("micro_batch", "step"),
         f"parallel.fsdp_grad_sync must be micro_batch or step, got '{p.fsdp_grad_sync}'")
    need(p.shard_size >= 0, f"parallel.shard_size must be >= 0 (0: shard over every data-parallel rank), got {p.shard_size}")
    need(p.gpus_per_node >= 0, f"parallel.gpus_per_node must be >= 0 (0: from the launcher), got {p.gpus_per_node}")
    need(0 < p.timeout_s < float("inf"), f"parallel.timeout_s must be a finite number of seconds > 0, got {p.timeout_s}")
    need(cfg.run.lock_stale_s >= 60, f"run.lock_stale_s must be >= 60 (twice the lock's 30 s heartbeat), got "
         f"{cfg.run.lock_stale_s}")
    ws = world_size(cfg)
    model_par = p.tp * p.cp * p.pp
    need(ws % model_par == 0,
         f"world size {ws} is not divisible by parallel.tp x parallel.cp x parallel.pp = {p.tp}x{p.cp}x{p.pp}")
    dp = ws // model_par
    need(p.shard_size == 0 or p.engine == "fsdp2",
         f"parallel.shard_size={p.shard_size} needs parallel.engine=fsdp2 (HSDP: FSDP2 sharding inside groups of "
         f"shard_size data-parallel ranks, replicas across them); the {p.engine} engine has no shard groups")
    need(p.fsdp_grad_sync == "micro_batch" or p.engine == "fsdp2",
         f"parallel.fsdp_grad_sync={p.fsdp_grad_sync} needs parallel.engine=fsdp2")
    need(p.shard_size == 0 or (p.shard_size <= dp and dp % p.shard_size == 0),
         f"parallel.shard_size={p.shard_size} must divide the {dp} data-parallel ranks (world size {ws} / "
         f"(parallel.tp x parallel.cp x parallel.pp = {model_par})): each shard group is shard_size ranks, the "
         f"groups replicate, so data-parallel ranks = shard_size x replicas")
    need(p.gpus_per_node == 0 or ws <= p.gpus_per_node or ws % p.gpus_per_node == 0,
         f"parallel.gpus_per_node={p.gpus_per_node} must divide the world size {ws} (whole nodes)")
    need(t.global_batch % (t.micro_batch * dp) == 0,
         f"batch triad: train.global_batch={t.global_batch} must be a multiple of "
         f"train.micro_batch x data-parallel ranks = {t.micro_batch} x {dp}")
    n_stages = m.pattern.count("|") + 1
    need(p.pp_schedule in ("1f1b", "gpipe"), f"parallel.pp_schedule must be 1f1b or gpipe, got '{p.pp_schedule}'")
    need(p.pp_virtual >= 1, f"parallel.pp_virtual must be >= 1, got {p.pp_virtual}")
    need(p.pp_virtual == 1 or p.pp > 1, f"parallel.pp_virtual={p.pp_virtual} needs parallel.pp > 1")
    pipe = p.pp * p.pp_virtual
    need(p.pp == 1 or n_stages in (1, pipe),
         f"model.pattern has {n_stages} stages (cut by '|') but parallel.pp x parallel.pp_virtual = {pipe}")
    need(pipe == 1 or n_stages == 1 or all(blocks_of(st) for st in m.pattern.split("|")),
         f"model.pattern '{m.pattern}': every pipeline stage (between '|') needs at least one block")
    need(pipe == 1 or len(blocks_of(m.pattern)) >= pipe,
         f"model.pattern has {len(blocks_of(m.pattern))} blocks, fewer than the parallel.pp x parallel.pp_virtual "
         f"= {pipe} pipeline stages")
    accum = t.global_batch // max(t.micro_batch * dp, 1)
    rounds = max(1, accum // p.pp)
    need(p.pp_virtual == 1 or p.pp_schedule != "1f1b" or accum % rounds == 0,
         f"parallel.pp_virtual={p.pp_virtual} (interleaved 1F1B): the {accum} micro-batches of a step "
         f"(train.global_batch / (train.micro_batch x data-parallel ranks)) must be a multiple of "
         f"max(1, micro-batches // parallel.pp) = {rounds}")

    # last, so a key's own check (its range, with why) speaks first: any float still infinite or NaN here (e.g.
    # optim.lr=inf passes lr > 0) would fail only once training computes with it
    for key, v in _float_values(cfg):
        need(math.isfinite(v) or (key in _MAY_BE_INF and v == math.inf), f"{key} must be a finite number, got {v}")
