"""`megassm-eval` / `python -m megassm.evaluation.cli`: evaluate a trained checkpoint (docs/evaluation.md).

    megassm-eval context --run runs/tiny                      # perplexity by context length, carried state
    megassm-eval context --run runs/x --checkpoint runs/x/checkpoints/step_00001000 --window 2048 --max-tokens 65536
    megassm-eval context --run runs/x data.paths=[/data/pg19_text_document] --split test
    megassm-eval harness --run runs/x --tasks hellaswag,arc_easy --limit 200 --output results.json

`context` writes RUN/eval/context_step_XXXXXXXX.{json,md,png} (the PNG needs matplotlib) and prints the table;
overrides (key=value) change the run's saved config, e.g. to evaluate on other data. `harness` runs
lm-evaluation-harness tasks (pip install lm_eval) on the model directly. The form without a subcommand
(`megassm-eval --run ...`) is `context`, as before.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from megassm.config import ConfigError, load_config

COMMANDS = ("context", "harness")


def _context_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="run directory (its config.yaml and checkpoints/)")
    p.add_argument("--config", default=None, help="config file (default: RUN/config.yaml)")
    p.add_argument("--checkpoint", default="auto", help="auto (the newest checkpoint in RUN that verifies) | PATH | "
                                                        "none (init weights)")
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


def _harness_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory (RUN/checkpoints/step_XXXXXXXX)")
    src.add_argument("--run", help="run directory: its newest checkpoint that verifies")
    p.add_argument("--tasks", required=True, help="comma-separated lm-evaluation-harness task names")
    p.add_argument("--limit", type=float, default=None, help="documents per task (< 1: a fraction)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--output", default=None, help="results JSON (default: print only)")
    p.add_argument("--include-path", default=None, help="folder of extra task YAML files")
    p.add_argument("--no-builtin-tasks", action="store_true",
                   help="only the tasks under --include-path (skips indexing the harness's own)")
    p.add_argument("--max-length", type=int, default=None, help="cut longer contexts on the left (default: never)")
    p.add_argument("--bootstrap-iters", type=int, default=100000, help="for standard errors (0: none)")
    p.add_argument("--seed", type=int, default=0, help="few-shot sampling and generation seed")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec (default: the run's data.tokenizer)")
    p.add_argument("--config", default=None, help="config file (default: the checkpoint's recorded config)")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default=None, choices=["auto", "fp32", "bf16"])
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megassm-eval", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    _context_args(sub.add_parser("context", help="perplexity by context length, streaming with carried state"))
    _harness_args(sub.add_parser("harness", help="lm-evaluation-harness tasks"))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["context"] + argv  # the form from before the subcommands
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s",
                        stream=sys.stderr)
    return harness_main(args) if args.command == "harness" else context_main(args)


def harness_main(args) -> int:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("megassm-eval harness: needs lm-evaluation-harness (the lm_eval package): pip install 'megassm[eval]'", file=sys.stderr)
        return 2
    from megassm.evaluation.harness import run_harness
    from megassm.evaluation.loading import load_trained
    from megassm.training.checkpoint import CheckpointDamagedError
    from megassm.training.failures import EXIT_NO_CHECKPOINT

    try:
        trained = load_trained(checkpoint=args.checkpoint, run=args.run, config=args.config,
                               overrides=args.overrides, tokenizer=args.tokenizer, device=args.device,
                               precision=args.precision)
        limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
        res = run_harness(trained, [t.strip() for t in args.tasks.split(",") if t.strip()], limit=limit,
                          batch_size=args.batch_size, num_fewshot=args.num_fewshot, include_path=args.include_path,
                          include_defaults=not args.no_builtin_tasks, max_length=args.max_length, seed=args.seed,
                          bootstrap_iters=args.bootstrap_iters)
    except CheckpointDamagedError as e:  # no checkpoint that verifies: exit 6, as every reader of checkpoints
        print(f"megassm-eval harness: {e}", file=sys.stderr)
        return EXIT_NO_CHECKPOINT
    except (ConfigError, ValueError, KeyError, OSError) as e:
        print(f"megassm-eval harness: {e}", file=sys.stderr)
        return 2
    summary = {
        "checkpoint": trained.checkpoint, "step": trained.step, "tokenizer": trained.tokenizer.name,
        "device": str(trained.device), "precision": trained.precision, "limit": args.limit,
        "num_fewshot": args.num_fewshot, "results": res.get("results", {}), "n-shot": res.get("n-shot", {}),
        "versions": res.get("versions", {}), "n-samples": res.get("n-samples", {}),
    }
    for task, metrics in summary["results"].items():
        shown = ", ".join(f"{k.split(',')[0]}={v:.4f}" for k, v in metrics.items()
                          if isinstance(v, float) and "stderr" not in k)
        print(f"{task}: {shown}")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=2, default=str)
            f.write("\n")
        print(f"megassm-eval harness: wrote {args.output}", file=sys.stderr)
    return 0


def context_main(args) -> int:
    from megassm.evaluation.context import context_length_eval, markdown_table, plot
    from megassm.training import checkpoint as ckpt
    from megassm.training.checkpoint import CheckpointDamagedError
    from megassm.training.failures import EXIT_NO_CHECKPOINT

    try:
        cfg = load_config(args.config or os.path.join(args.run, "config.yaml"), list(args.overrides))
        if args.checkpoint == "none":
            path = None
        elif args.checkpoint == "auto":  # the run's newest checkpoint that verifies, as every reader of checkpoints
            path, _ = ckpt.checkpoint_to_read(args.run, "--run", expect="run", model_only=True)
        else:
            path, _ = ckpt.checkpoint_to_read(args.checkpoint, "--checkpoint", model_only=True)
        edges = [int(x) for x in args.edges.split(",")] if args.edges else None
        res = context_length_eval(cfg, path, window=args.window, max_tokens=args.max_tokens, num_docs=args.docs,
                                  batch_size=args.batch_size, split=args.split, device=args.device, edges=edges,
                                  baseline=not args.no_baseline, verify=False)
    except CheckpointDamagedError as e:
        print(f"megassm-eval: {e}", file=sys.stderr)
        return EXIT_NO_CHECKPOINT
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
