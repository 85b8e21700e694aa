"""`megassm-train` / `python -m megassm.train`: train a model from a YAML config with dotted overrides.

    megassm-train --config configs/tiny.yaml model.d_model=256 train.steps=50 run.dir=runs/x
    megassm-train --config configs/tiny.yaml --resume auto
    megassm-train --config configs/mamba2-1.3b.yaml --dry-run
"""
from __future__ import annotations

import argparse
import logging
import sys

from megassm.config import ConfigError, dump_config, load_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megassm-train",
        description="Train a Mamba-2 / hybrid language model. Overrides are dotted key=value pairs "
        "after the options, e.g. model.d_model=256 train.steps=50 run.dir=runs/x (docs/config.md lists every key).",
    )
    p.add_argument("--config", required=True, help="YAML config file (see configs/)")
    p.add_argument("--resume", default=None, help="none | auto (newest complete checkpoint in run.dir) | PATH")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config, build the model on the meta device and print it; no training")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p


def dry_run(cfg) -> None:
    """Check the config and report model size without allocating weights or touching a GPU."""
    import torch

    from megassm.models import build_model
    from megassm.training.flops import flops_per_sequence

    vocab = cfg.model.vocab_size or 257  # byte tokenizer when the data decides the vocabulary
    with torch.device("meta"):
        model = build_model(cfg.model, vocab_size=vocab, device="meta")
    fl = flops_per_sequence(cfg.model, model.vocab_size_padded, cfg.train.seq_len)
    print(dump_config(cfg), end="")
    print(f"# blocks: {model.n_layers}  parameters: {model.num_parameters() / 1e6:.2f}M  "
          f"train FLOPs/token: {3 * fl['total'] / cfg.train.seq_len:.4g}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s",
                        stream=sys.stderr)
    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"run.resume={args.resume}")
    try:
        cfg = load_config(args.config, overrides)
        if args.dry_run:
            dry_run(cfg)
            return 0
        from megassm.training.trainer import NonFiniteLossError, Trainer

        trainer = Trainer(cfg)
    except ConfigError as e:
        print(f"megassm-train: config error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.fit()
    except NonFiniteLossError as e:
        print(f"megassm-train: {e}", file=sys.stderr)
        return 3
    finally:
        from megassm.parallel.state import destroy

        destroy()  # process groups of a torchrun launch (no-op for one process)
    print(f"megassm-train: done, {trainer.step} steps; run directory {cfg.run.dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
