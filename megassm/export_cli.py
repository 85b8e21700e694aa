"""megassm-export: a checkpoint as a Hugging Face transformers model directory (docs/interop.md).

    megassm-export --checkpoint runs/x/checkpoints/step_00001000 --format hf --output exports/x-1000
    megassm-export --run runs/x --format hf --output exports/x       # the run's newest complete checkpoint

Patterns of `M` blocks become Mamba2ForCausalLM; `M` / `*` / `-` hybrids NemotronHForCausalLM (attention without
RoPE, model.mlp.activation=relu2). Anything else is refused, naming the block, and nothing is written. Canonical
and sharded checkpoints both work. The run's tokenizer travels when it is known (the builtin corpus's
data.tokenizer, byte-level shards) or named with --tokenizer.
"""
from __future__ import annotations

import argparse
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

    named = checkpoint or run
    who = "--checkpoint" if checkpoint else "--run"
    full = os.path.abspath(os.path.expanduser(named))
    if not os.path.isdir(full):
        raise sources.InitFromError(f"{who}: {full} does not exist or is not a directory")
    ckpt_dir = sources.checkpoint_of(full, who)
    cfg = sources.checkpoint_config(ckpt_dir, who)
    from megassm.interop.mapping import export_target

    export_target(cfg.model)  # refuse before reading any weights
    spec = None if no_tokenizer else tokenizer_spec(cfg, tokenizer)
    state = ckpt.read_model_state(ckpt_dir)
    info = export_hf(cfg.model, state, output, tokenizer_spec=spec, source=ckpt_dir, dtype=_DTYPES[dtype],
                     max_shard_bytes=int(max_shard_gb * (1 << 30)), no_tokenizer=no_tokenizer)
    info["checkpoint"] = ckpt_dir
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megassm-export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a complete checkpoint directory (step_XXXXXXXX), canonical or sharded")
    src.add_argument("--run", help="a run directory: its newest complete checkpoint")
    ap.add_argument("--format", required=True, choices=["hf"], help="hf: a transformers model directory")
    ap.add_argument("--output", required=True, help="the directory to create (must not exist)")
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

    try:
        info = export(a.checkpoint, a.run, a.output, a.tokenizer, a.no_tokenizer, a.dtype, a.max_shard_gb)
    except (ConfigError, ExportError, NotExportable, TokenizerExportError, OSError) as e:
        print(f"megassm-export: error: {e}", file=sys.stderr)
        return 2
    print(f"megassm-export: wrote {os.path.abspath(a.output)} ({info['architecture']}) from {info['checkpoint']}")
    print(f"megassm-export: tokenizer: {info['tokenizer']}")
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
