"""megassm-export: a checkpoint as a Hugging Face transformers model directory (docs/interop.md).

    megassm-export --checkpoint runs/x/checkpoints/step_00001000 --format hf --output exports/x-1000
    megassm-export --run runs/x --format hf --output exports/x       # the run's newest checkpoint that verifies

stdout: the absolute path of the directory written (the one result line); what was written from what, and
errors, go to stderr. Missing parent directories of --output are made (and removed again if the export fails).

Patterns of `M` blocks become Mamba2ForCausalLM; `M` / `*` / `-` hybrids the first transformers class that computes
the same function: NemotronHForCausalLM (attention without RoPE, model.mlp.activation=relu2), else
GraniteMoeHybridForCausalLM (SwiGLU, RoPE or none; each `-` right after an M or *). Anything else is refused, naming
the block and the reason, and nothing is written. Canonical and sharded checkpoints both work. The run's tokenizer
travels when it is known (the builtin corpus's data.tokenizer, byte-level shards) or named with --tokenizer.

The checkpoint is verified against its integrity record before anything is written (training/checkpoint/choose.py
checkpoint_to_read, as every reader of checkpoints). Exit codes: 0 written; 2 a refusal (config, pattern,
tokenizer, output) naming what; 6 no checkpoint that verifies (the file, expected and found hash named).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export(checkpoint: str | None, run: str | None, output: str, tokenizer: str | None = None,
           no_tokenizer: bool = False, dtype: str = "fp32", max_shard_gb: float = 5.0) -> dict:
    from megassm.interop import sources
    from megassm.interop.hf import export_hf
    from megassm.interop.tokenizer import tokenizer_spec
    from megassm.training import checkpoint as ckpt

    from megassm.interop.mapping import export_target

    who = "--checkpoint" if checkpoint else "--run"

    def read(ckpt_dir: str):
        cfg = sources.checkpoint_config(ckpt_dir, who)
        export_target(cfg.model)  # refuse before loading any weights
        return cfg, ckpt.read_model_state(ckpt_dir)

    # verified as every reader does (a run directory: its newest checkpoint that verifies); nothing is written before
    ckpt_dir, (cfg, state) = ckpt.checkpoint_to_read(checkpoint or run, who, model_only=True, load=read)
    spec = None if no_tokenizer else tokenizer_spec(cfg, tokenizer)
    info = export_hf(cfg.model, state, output, tokenizer_spec=spec, source=ckpt_dir, dtype=_DTYPES[dtype],
                     max_shard_bytes=int(max_shard_gb * (1 << 30)), no_tokenizer=no_tokenizer,
                     max_positions=cfg.train.seq_len)
    info["checkpoint"] = ckpt_dir
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megassm-export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a checkpoint directory (step_XXXXXXXX), canonical or sharded; it must "
                                          "verify (exit 6 if damaged)")
    src.add_argument("--run", help="a run directory: its newest checkpoint that verifies (damaged ones skipped, "
                                   "named in a warning)")
    ap.add_argument("--format", required=True, choices=["hf"], help="hf: a transformers model directory")
    ap.add_argument("--output", required=True, help="the directory to create (must not exist; missing parent "
                                                    "directories are made); its path is printed on stdout")
    ap.add_argument("--tokenizer", default=None, help="the run's tokenizer (byte, tokenizer.json, .model) when the "
                                                      "data manifests do not record its path")
    ap.add_argument("--no-tokenizer", action="store_true", help="export the model alone")
    ap.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES), help="weights' dtype (default fp32, the "
                                                                             "master weights bit for bit)")
    ap.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size (default 5)")
    a = ap.parse_args(argv)
    from megassm.config import ConfigError
    from megassm.interop.hf import ExportError
    from megassm.interop.mapping import NotExportable
    from megassm.interop.tokenizer import TokenizerExportError

    from megassm.training.checkpoint import CheckpointDamagedError
    from megassm.training.failures import EXIT_CONFIG, EXIT_NO_CHECKPOINT

    logging.basicConfig(level=logging.WARNING, format="megassm-export: %(levelname)s: %(message)s")
    try:
        info = export(a.checkpoint, a.run, a.output, a.tokenizer, a.no_tokenizer, a.dtype, a.max_shard_gb)
    except CheckpointDamagedError as e:  # no checkpoint that verifies: exit 6, as megassm-train's run.resume
        print(f"megassm-export: error: {e}", file=sys.stderr)
        return EXIT_NO_CHECKPOINT
    except (ConfigError, ExportError, NotExportable, TokenizerExportError, OSError) as e:
        print(f"megassm-export: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"megassm-export: wrote {os.path.abspath(a.output)} ({info['architecture']}) from {info['checkpoint']}",
          file=sys.stderr)
    print(f"megassm-export: tokenizer: {info['tokenizer']}", file=sys.stderr)
    print(os.path.abspath(a.output))  # the result on stdout: the directory written
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
