"""`megassm-generate`: continue prompts with a trained checkpoint (recurrent decode, docs/evaluation.md).

    megassm-generate --run runs/tiny --prompt "def main(" --max-new-tokens 64            # greedy
    megassm-generate --checkpoint runs/x/checkpoints/step_00001000 --prompt "Once" --prompt "The" \\
        --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1

Prints each prompt followed by its completion (--json: one JSON object per prompt with the token ids).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megassm-generate", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory (RUN/checkpoints/step_XXXXXXXX)")
    src.add_argument("--run", help="run directory: its newest checkpoint that verifies")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1: off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same output on a device)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's end-of-document token")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec (default: the run's data.tokenizer)")
    p.add_argument("--config", default=None, help="config file (default: the checkpoint's recorded config)")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default=None, choices=["auto", "fp32", "bf16"],
                   help="default: the run's train.precision (bf16 autocast on GPU, fp32 on CPU)")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt instead of text")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s: %(message)s",
                        stream=sys.stderr)
    from megassm.config import ConfigError
    from megassm.evaluation.generation import generate
    from megassm.evaluation.loading import load_trained
    from megassm.training.checkpoint import CheckpointDamagedError
    from megassm.training.failures import EXIT_NO_CHECKPOINT

    try:
        lm = load_trained(checkpoint=args.checkpoint, run=args.run, config=args.config, overrides=args.overrides,
                          tokenizer=args.tokenizer, device=args.device, precision=args.precision)
        tok = lm.tokenizer
        prompts = [tok.encode(p) for p in args.prompt]
        gen = generate(lm.model, prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed, eos_id=None if args.ignore_eos else tok.eos_id,
                       autocast=lm.autocast)
    except CheckpointDamagedError as e:  # no checkpoint that verifies: exit 6, as every reader of checkpoints
        print(f"megassm-generate: {e}", file=sys.stderr)
        return EXIT_NO_CHECKPOINT
    except (ConfigError, ValueError, OSError) as e:
        print(f"megassm-generate: {e}", file=sys.stderr)
        return 2
    for text, ids, new, why in zip(args.prompt, prompts, gen.tokens, gen.stopped):
        shown = new[:-1] if why == "eos" else new
        if args.json:
            print(json.dumps({"prompt": text, "completion": tok.decode(shown), "prompt_tokens": ids,
                              "tokens": new, "stopped": why, "step": lm.step}))
        else:
            print(text + tok.decode(shown))
            if len(args.prompt) > 1:
                print("-" * 40)
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
