"""megassm-checkpoint: convert a checkpoint between the canonical single-file layout (model.pt / optim.pt) and the
sharded layout (DCP chunks, run.checkpoint_format=sharded), in one process on the CPU (no torchrun).

    megassm-checkpoint convert --input runs/x/checkpoints/step_00001000 --output /tmp/step_1000-canonical --to canonical
    megassm-checkpoint convert --input DIR --output DIR --to sharded [--config runs/x/config.yaml]
    megassm-checkpoint convert --input CKPT --output MEGATRON_DIR --to megatron [--tp N] [--megatron-format legacy]
    megassm-checkpoint convert --input MEGATRON_DIR --output CKPT --to canonical [--config our.yaml]

stdout: the absolute path of the checkpoint written (the one result line); the rest goes to stderr.

The tensors are carried bit for bit; the extra states (<key>.pt) are copied byte for byte and meta.json's fields
kept (its "files", "format" and "integrity" rewritten). The input must verify against its integrity record (exit 6
otherwise, naming the file, expected and found). The output is written under a temporary name beside it and
renamed once complete: a failure leaves nothing at --output. Canonical -> sharded needs the optimizer's parameter
names by index: from the checkpoint's param_names.pt (written by the trainer), else from the model built from
--config (default: the run's config.yaml two levels above the checkpoint).

Megatron-LM (megatron-core's MambaModel, megassm/interop/megatron.py): --to megatron writes the weights of a checkpoint
(either format) as Megatron-LM's release checkpoint, torch_dist (TP-agnostic: loads at any --tensor-model-parallel-size)
or legacy mp_rank_XX files for --tp ranks; a Megatron-LM checkpoint directory as --input with --to canonical gives a
megassm checkpoint (the model config from the checkpoint's Megatron-LM arguments, or --config). Weights only: optimizer
states are not converted. docs/interop.md "Megatron-LM".
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys

from megassm.training import checkpoint as ckpt
from megassm.training.checkpoint import sharded
from megassm.training.failures import EXIT_NO_CHECKPOINT


class ConvertError(Exception):
    pass


def _param_names_from_config(config: str, model_state: dict) -> list[str]:
    from megassm.config import load_config
    from megassm.models import build_model

    cfg = load_config(config, [])
    vocab = model_state["embedding.weight"].shape[0] if "embedding.weight" in model_state else None
    model = build_model(cfg.model, vocab_size=vocab, device="meta")
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in model.param_groups(cfg.optim.weight_decay) for p in g["params"]]


def _param_names(src: str, meta: dict, model_state: dict, optim_state: dict | None, config: str | None) -> list[str]:
    if optim_state is None:
        return []
    n = sum(len(g["params"]) for g in optim_state["param_groups"])
    if "param_names" in meta.get("extra_files", []):
        names = ckpt.torch_load(os.path.join(src, "param_names.pt"), "cpu")
        how = os.path.join(src, "param_names.pt")
    else:
        config = config or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(src))), "config.yaml")
        if not os.path.isfile(config):
            raise ConvertError(f"{src}: no param_names.pt and no config at {config} to name the optimizer's "
                               "parameters; pass --config (the run's config.yaml)")
        names = _param_names_from_config(config, model_state)
        how = config
    if len(names) != n or any(nm not in model_state for nm in names):
        raise ConvertError(f"{src}: the optimizer has {n} parameters; the names from {how} ({len(names)}) do not "
                           "match the checkpoint's model")
    return list(names)


MEGATRON = "megatron"
TARGETS = (*sharded.FORMATS, MEGATRON)


def convert(src: str, dst: str, to: str, config: str | None = None, tp: int = 1, megatron_format: str = "torch_dist",
            dtype: str = "fp32") -> str:
    """Convert the complete checkpoint `src` into `dst` (which must not exist) in format `to`. `tp`, `megatron_format`
    and `dtype` apply to --to megatron; a Megatron-LM checkpoint as `src` converts --to canonical."""
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    if to not in TARGETS:
        raise ConvertError(f"--to must be one of {', '.join(TARGETS)}, got '{to}'")
    if not os.path.isdir(src):
        raise ConvertError(f"{src}: not a directory")
    if to == MEGATRON or (to == sharded.CANONICAL and ckpt.read_meta(src) is None and _is_megatron(src)):
        return _convert_megatron(src, dst, to, config, tp, megatron_format, dtype)
    meta = ckpt.read_meta(src)
    if meta is None and not ckpt.checkpoint_dir_name(src):
        raise ConvertError(f"{src}: not a checkpoint (no readable meta.json)")
    if os.path.lexists(dst):
        raise ConvertError(f"{dst}: output exists; choose a new path")
    parent = os.path.dirname(dst)
    if not os.path.isdir(parent):
        raise ConvertError(f"{parent}: output directory's parent does not exist")
    # complete and every file verified, as every reader of checkpoints (exit 6 when damaged): a copy of damaged
    # bytes would get a fresh integrity record and pass for intact
    ckpt.checkpoint_to_read(src, "--input", expect="checkpoint")
    fmt = meta.get("format", sharded.CANONICAL)
    if fmt not in sharded.FORMATS:
        raise ConvertError(f"{src}: unknown checkpoint format '{fmt}'")
    if fmt == to:
        raise ConvertError(f"{src}: already in the {to} format")
    tmp = os.path.join(parent, f".tmp-{os.path.basename(dst)}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        model_state, optim_state = ckpt.read_model_and_optim(src)
        if to == sharded.SHARDED:
            names = _param_names(src, meta, model_state, optim_state, config)
            os.makedirs(os.path.join(tmp, sharded.DCP_DIR))
            sharded.write_sharded_from_canonical(tmp, model_state, optim_state, names)
        else:
            sharded.write_canonical(tmp, model_state, optim_state)
        del model_state, optim_state
        for key in meta.get("extra_files", []):
            shutil.copyfile(os.path.join(src, f"{key}.pt"), os.path.join(tmp, f"{key}.pt"))
        files = sharded.dir_files(tmp)
        out = {k: v for k, v in meta.items() if k not in ("files", "format", "integrity", "complete", "world_size")}
        if to == sharded.SHARDED:
            out["format"] = sharded.SHARDED
        out["converted_from"] = fmt
        out["files"] = files
        out["integrity"] = ckpt.integrity_record(tmp, files)
        out["complete"] = True
        ckpt.publish(tmp, dst, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _is_megatron(src: str) -> bool:
    from megassm.interop import megatron

    return megatron.is_megatron_checkpoint(src)


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _new_output(dst: str) -> str:
    """The temporary directory beside `dst` that is renamed to it once complete."""
    if os.path.lexists(dst):
        raise ConvertError(f"{dst}: output exists; choose a new path")
    parent = os.path.dirname(dst)
    if not os.path.isdir(parent):
        raise ConvertError(f"{parent}: output directory's parent does not exist")
    tmp = os.path.join(parent, f".tmp-{os.path.basename(dst)}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def _convert_megatron(src: str, dst: str, to: str, config: str | None, tp: int, fmt: str, dtype: str) -> str:
    """megassm checkpoint -> Megatron-LM release checkpoint (to == "megatron"), or Megatron-LM checkpoint -> megassm
    canonical checkpoint. Everything is checked before the first byte is written; the output appears whole or not."""
    import torch

    from megassm.config import Config, ConfigError, dump_config, load_config
    from megassm.interop import mapping, megatron
    from megassm.interop.sources import checkpoint_config

    log = logging.getLogger("megassm.checkpoint")
    try:
        if to == MEGATRON:
            if tp < 1:
                raise ConvertError(f"--tp must be >= 1, got {tp}")
            if fmt not in megatron.FORMATS:
                raise ConvertError(f"--megatron-format must be one of {', '.join(megatron.FORMATS)}, got '{fmt}'")
            if dtype not in _DTYPES:
                raise ConvertError(f"--dtype must be one of {', '.join(_DTYPES)}, got '{dtype}'")
            if ckpt.read_meta(src) is None and not ckpt.checkpoint_dir_name(src):
                raise ConvertError(f"{src}: not a megassm checkpoint (no readable meta.json)")
            cfg = load_config(config, [], validate_config=False) if config else checkpoint_config(src, "--input")
            m = cfg.model
            megatron.check_expressible(m, tp)  # before any weight is read
            if fmt == "torch_dist":
                megatron.require_megatron_core()
            tmp = _new_output(dst)
            ckpt.checkpoint_to_read(src, "--input", expect="checkpoint", model_only=True)
            state = ckpt.read_model_state(src)
            vocab = state["embedding.weight"].shape[0]
            megatron.check_expressible(m, tp, vocab)
            expected = megatron.expected_shapes(m, vocab)
            tensors = megatron.to_megatron(state, m)
            bad = [k for k in expected if k not in tensors or tuple(tensors[k].shape) != expected[k]]
            if bad or len(tensors) != len(expected):
                raise ConvertError(f"{src}: its weights do not match its model config (first: '{(bad or ['?'])[0]}')")
            torch_dtype = getattr(torch, _DTYPES[dtype])
            args = megatron.megatron_args(m, vocab, tp, torch_dtype, fmt)
            os.makedirs(tmp)
            try:
                files = megatron.write_megatron(tmp, tensors, args, m, fmt, tp, torch_dtype)
                os.rename(tmp, dst)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            log.info("wrote Megatron-LM %s checkpoint %s (%d files, %s, tensor-parallel %d%s); weights only, no "
                        "optimizer state", fmt, dst, len(files), dtype, tp,
                        "" if fmt == "legacy" else ": torch_dist loads at any degree")
            return dst
        given = load_config(config, [], validate_config=False) if config else None
        tmp = _new_output(dst)
        state, m, facts = megatron.read_megatron(src, None if given is None else given.model)
        if given is not None and facts["args"] is not None:
            # the arguments the checkpoint recorded must describe the model of --config
            from_args, _ = megatron.model_config_from_args(facts["args"], {k: tuple(v.shape) for k, v in
                                                                          megatron.to_megatron(state, m).items()})
            diffs = mapping.config_differences(from_args, m, mapping.FOREIGN_KEYS)
            if diffs:
                named = "; ".join(f"model.{k}: {a!r} in the checkpoint, {b!r} in --config" for k, a, b in diffs)
                raise ConvertError(f"{src}: --config disagrees with the checkpoint's Megatron-LM arguments: {named}")
        cfg = given if given is not None else Config(model=m)
        if facts["dtype"] != "float32":
            log.warning("%s holds %s weights: the canonical checkpoint keeps them as fp32 (exact); Megatron's fp32 "
                        "master weights (optimizer state) are not read", facts["dir"], facts["dtype"])
        os.makedirs(tmp)
        try:
            files = sharded.write_canonical(tmp, state, None)
            out = {"config": dump_config(cfg), "step": 0, "converted_from": f"megatron-{facts['format']}",
                   "megatron_tp": facts["tp"], "files": files, "extra_files": [],
                   "integrity": ckpt.integrity_record(tmp, files), "complete": True}
            ckpt.publish(tmp, dst, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dst
    except ckpt.CheckpointError:
        raise  # damaged (exit 6) or unreadable input, as every reader of checkpoints reports it
    except (megatron.MegatronError, ConfigError) as e:
        raise ConvertError(str(e)) from e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megassm-checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="canonical <-> sharded, and <-> Megatron-LM")
    c.add_argument("--input", required=True, help="a complete checkpoint directory (step_XXXXXXXX)")
    c.add_argument("--output", required=True, help="the new checkpoint directory (must not exist)")
    c.add_argument("--to", required=True, choices=TARGETS)
    c.add_argument("--config", default=None, help="the run's config.yaml (canonical -> sharded of checkpoints "
                                                  "written before param_names.pt existed; the model of a Megatron "
                                                  "checkpoint, instead of its arguments)")
    c.add_argument("--tp", type=int, default=1, help="--to megatron: tensor-parallel degree the checkpoint is checked "
                                                     "for (torch_dist) or split into (legacy)")
    c.add_argument("--megatron-format", default="torch_dist", help="--to megatron: torch_dist (default) or legacy "
                                                                  "(mp_rank_XX/model_optim_rng.pt)")
    c.add_argument("--dtype", default="fp32", help="--to megatron: fp32 (default), bf16 or fp16")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    try:
        path = convert(a.input, a.output, a.to, a.config, a.tp, a.megatron_format, a.dtype)
    except ckpt.CheckpointDamagedError as e:  # no checkpoint that verifies: exit 6, as every reader of checkpoints
        print(f"megassm-checkpoint: error: {e}", file=sys.stderr)
        return EXIT_NO_CHECKPOINT
    except (ConvertError, ckpt.CheckpointError) as e:
        print(f"megassm-checkpoint: error: {e}", file=sys.stderr)
        return 2
    print(f"megassm-checkpoint: wrote {path} ({a.to})", file=sys.stderr)
    print(path)  # the result on stdout: the checkpoint written
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
