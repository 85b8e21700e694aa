"""megassm-checkpoint: convert a checkpoint between the canonical single-file layout (model.pt / optim.pt) and the
sharded layout (DCP chunks, run.checkpoint_format=sharded), in one process on the CPU (no torchrun).

    megassm-checkpoint convert --input runs/x/checkpoints/step_00001000 --output /tmp/step_1000-canonical --to canonical
    megassm-checkpoint convert --input DIR --output DIR --to sharded [--config runs/x/config.yaml]

stdout: the absolute path of the checkpoint written (the one result line); the rest goes to stderr.

The tensors are carried bit for bit; the extra states (<key>.pt) are copied byte for byte and meta.json's fields
kept (its "files", "format" and "integrity" rewritten). The input must verify against its integrity record (exit 6
otherwise, naming the file, expected and found). The output is written under a temporary name beside it and
renamed once complete: a failure leaves nothing at --output. Canonical -> sharded needs the optimizer's parameter
names by index: from the checkpoint's param_names.pt (written by the trainer), else from the model built from
--config (default: the run's config.yaml two levels above the checkpoint).
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys

from megassm.training import checkpoint as ckpt
from megassm.training import sharded
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
        names = ckpt._torch_load(os.path.join(src, "param_names.pt"), "cpu")
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


def convert(src: str, dst: str, to: str, config: str | None = None) -> str:
    """Convert the complete checkpoint `src` into `dst` (which must not exist) in format `to`."""
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    if to not in sharded.FORMATS:
        raise ConvertError(f"--to must be one of {', '.join(sharded.FORMATS)}, got '{to}'")
    if not os.path.isdir(src):
        raise ConvertError(f"{src}: not a directory")
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
        files = sharded._dir_files(tmp)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megassm-checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="canonical <-> sharded")
    c.add_argument("--input", required=True, help="a complete checkpoint directory (step_XXXXXXXX)")
    c.add_argument("--output", required=True, help="the new checkpoint directory (must not exist)")
    c.add_argument("--to", required=True, choices=sharded.FORMATS)
    c.add_argument("--config", default=None, help="the run's config.yaml (canonical -> sharded of checkpoints "
                                                  "written before param_names.pt existed)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    try:
        path = convert(a.input, a.output, a.to, a.config)
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
