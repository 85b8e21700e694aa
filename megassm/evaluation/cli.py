"""`megassm-eval` / `python -m megassm.evaluation.cli`: perplexity by context length with carried state.

    megassm-eval --run runs/tiny                              # newest checkpoint, window = train.seq_len
    megassm-eval --run runs/x --checkpoint runs/x/checkpoints/step_00001000 --window 2048 --max-tokens 65536
    megassm-eval --run runs/x data.paths=[/data/pg19_text_document] --split test

Writes RUN/eval/context_step_XXXXXXXX.{json,md,png} (the PNG needs matplotlib) and prints the table.
Overrides (key=value) change the run's saved config, e.g. to evaluate on other data.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from megassm.config import ConfigError, load_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megassm-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory (its config.yaml and checkpoints/)")
    p.add_argument("--config", default=None, help="config file (default: RUN/config.yaml)")
    p.add_argument("--checkpoint", default="auto", help="auto (newest complete in RUN) | PATH | none (init weights)")
    p.add_argument("--window", type=int, default=None, help="tokens per window (default: train.seq_len)")
    p.add_argument("--max-tokens", type=int, default=32768, help="tokens read per document")
    p.add_argument("--docs", type=int, default=64, help="number of (longest) held-out documents")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--split", default="valid", choices=["valid", "test", "train"])
    p.add_argument("--device", default="auto")
    p.add_argument("--edges", default=None, help="bucket edges, e.g. 0,512,1024,2048 (default: doubling)")
    p.add_argument("--no-baseline", action="store_true", help="skip the reset-every-window comparison run")
    p.add_argument("--out", default=None, help="output directory (default: RUN/eval)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s",
                        stream=sys.stderr)
    from megassm.evaluation.context import context_length_eval, markdown_table, plot
    from megassm.training import checkpoint as ckpt

    try:
        cfg = load_config(args.config or os.path.join(args.run, "config.yaml"), list(args.overrides))
        if args.checkpoint == "none":
            path = None
        elif args.checkpoint == "auto":
            path = ckpt.find_latest(args.run)
            if path is None:
                raise ConfigError(f"{args.run} has no complete checkpoint (pass --checkpoint PATH or none)")
        else:
            path = ckpt.resolve_resume(args.run, args.checkpoint)
        edges = [int(x) for x in args.edges.split(",")] if args.edges else None
        res = context_length_eval(cfg, path, window=args.window, max_tokens=args.max_tokens, num_docs=args.docs,
                                  batch_size=args.batch_size, split=args.split, device=args.device, edges=edges,
                                  baseline=not args.no_baseline)
    except (ConfigError, ValueError, OSError) as e:
        print(f"megassm-eval: {e}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.run, "eval")
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, "context_" + (f"step_{res['step']:08d}" if res["step"] is not None else "init"))
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=2)
        f.write("\n")
    table = markdown_table(res)
    with open(stem + ".md", "w") as f:
        f.write(table)
    wrote_png = plot(res, stem + ".png")
    print(table)
    print(f"megassm-eval: wrote {stem}.json, {stem}.md" + (f", {stem}.png" if wrote_png else " (no PNG: matplotlib missing)"),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
