"""Values that used to pass validation and fail only once training computed with them (optim.lr=inf), or after
run.dir was created (train.global_batch=0), or as a ZeroDivisionError traceback (parallel.tp=0): refused by
load_config, with one line naming the key and the value, before any file is written. Every float key of the
config is tried with inf, -inf and NaN, every integer key with 0 and -1 (docs/reliability.md)."""
import dataclasses
import os
import types
import typing

import pytest

from megassm import train as T
from megassm.config import Config, ConfigError, load_config
from megassm.training.failures import EXIT_CONFIG

# each section's keys are checked with a pattern that has its block (the block kinds' own checks then run too)
PATTERN = {"model.coffee.": "MC", "model.bmojo.": "MB", "model.mamba1.": "MS", "model.longhorn.": "ML"}
LISTS = {  # a valid list for each list key, with what it needs beside it
    "model.mamba.dt_limit": ("[0.001, 0.5]", []),
    "model.coffee.lam_init": ("[-1.0, -0.01]", []),
    "data.weights": ("[1.0, 2.0]", ["data.builtin=none", "data.paths=[a,b]"]),
    "data.split": ("[98.0, 1.0, 1.0]", []),
}
MAY_BE_INF = {("model.mamba.dt_limit", 1, "inf")}  # mamba_ssm's "no clamp": (0, inf)
ZERO_MEANS_SOMETHING = {  # 0 = off / unlimited / all / from the launcher; documented in docs/config.md
    "model.attn.sliding_window", "model.bmojo.n_fading", "model.bmojo.n_eidetic",
    "train.activation_checkpointing_blocks", "train.loss_chunk_tokens", "train.seed", "train.eval_interval",
    "train.eval_tokens", "train.spike_max_rollbacks", "train.straggler_interval", "optim.warmup_steps",
    "data.prefetch", "parallel.zero_stage", "parallel.fsdp_prefetch", "parallel.shard_size", "parallel.gpus_per_node",
    "run.save_interval", "run.keep_last", "run.profile_step",
}
ANY_INTEGER = {"train.seed"}  # the data orders take it modulo 2**64


def _leaves(cls=Config, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, prefix + f.name + ".")
        else:
            yield prefix + f.name, tp


def _kinds(tp):
    """'float', 'int', 'list' (of floats) or None for one annotation (Optional unwrapped)."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
    if any(typing.get_origin(a) is list and typing.get_args(a) == (float,) for a in args):
        return "list"
    return {float: "float", int: "int"}.get(args[0]) if args[0] is not bool else None


def _load(key, value, *extra):
    pattern = next((p for s, p in PATTERN.items() if key.startswith(s)), None)
    over = [*extra, f"{key}={value}"] + ([f"model.pattern={pattern}"] if pattern else [])
    return load_config("configs/tiny.yaml", over)


def _names(error, key, value):
    """One line that names the key and, after it, the value."""
    text = str(error)
    assert len(text.splitlines()) == 1 and key in text and value in text[text.index(key):], (key, value, text)


def test_the_sweep_covers_every_numeric_key():
    kinds = {k: _kinds(tp) for k, tp in _leaves()}
    assert set(LISTS) == {k for k, v in kinds.items() if v == "list"}
    assert sum(v == "float" for v in kinds.values()) >= 25 and sum(v == "int" for v in kinds.values()) >= 55
    assert ZERO_MEANS_SOMETHING <= {k for k, v in kinds.items() if v == "int"}


def test_every_float_key_must_be_finite():
    for key, tp in _leaves():
        kind = _kinds(tp)
        for bad in ("inf", "-inf", "nan"):
            if kind == "float":
                with pytest.raises(ConfigError) as e:
                    _load(key, bad)
                _names(e.value, key, bad)
            elif kind == "list":
                good, extra = LISTS[key]
                items = good.strip("[]").split(", ")
                for i in range(len(items)):
                    value = "[" + ", ".join(bad if j == i else x for j, x in enumerate(items)) + "]"
                    if (key, i, bad) in MAY_BE_INF:
                        _load(key, value, *extra)
                        continue
                    with pytest.raises(ConfigError) as e:
                        _load(key, value, *extra)
                    _names(e.value, key, bad)


def test_every_count_key_is_refused_below_its_smallest_value():
    for key, tp in _leaves():
        if _kinds(tp) != "int" or key in ANY_INTEGER:
            continue
        for bad in ("-1",) if key in ZERO_MEANS_SOMETHING else ("0", "-1"):
            with pytest.raises(ConfigError) as e:
                _load(key, bad)
            _names(e.value, key, bad)
        if key in ZERO_MEANS_SOMETHING:
            _load(key, "0")


@pytest.mark.parametrize("override, message", [
    (["optim.lr=inf"], "optim.lr must be a finite number, got inf"),
    (["train.global_batch=0"], "train.global_batch must be positive, got 0"),
    (["optim.eps=nan"], "optim.eps must be positive (it keeps AdamW's update finite where a gradient is 0), got nan"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay must be >= 0, got -0.1"),
    (["model.norm_eps=-inf"], "model.norm_eps must be positive, got -inf"),
    (["train.grad_clip=inf"], "train.grad_clip must be a finite number, got inf"),
    (["parallel.tp=0"], "parallel.tp must be positive, got 0"),
    (["data.prefetch=-1"], "data.prefetch must be >= 0 (0: synchronous), got -1"),
    (["run.overwrite=true", "--resume", "auto"], "run.overwrite=true starts a new run (the earlier one in run.dir "
     "moved aside) and run.resume=auto continues the earlier one: set only one of them"),
])
def test_megassm_train_refuses_before_any_file_is_written(tmp_path, capsys, override, message):
    run = tmp_path / "run"
    assert T.main(["--config", "configs/tiny.yaml", f"run.dir={run}", *override]) == EXIT_CONFIG
    assert capsys.readouterr().err.strip().splitlines() == [f"megassm-train: config error: {message}"]
    assert not os.path.exists(run)
