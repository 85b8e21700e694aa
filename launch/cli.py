"""`megassm-launch`: start training processes.

    megassm-launch local --nproc-per-node 1 --config configs/tiny.yaml [key=value ...] [--dry-run]

`local` runs `torchrun --standalone` on this machine with the same command line a cluster job runs
(`python -m megassm.train --config FILE overrides`). Cluster launchers (SLURM, the DeepSpeed launcher)
are added as further subcommands that build on `train_command`.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys


def train_command(config: str, overrides: list[str]) -> list[str]:
    """The per-process training command that every launcher runs."""
    return ["-m", "megassm.train", "--config", config, *overrides]


def torchrun_command(nproc_per_node: int, config: str, overrides: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc_per_node}", *train_command(config, overrides),
    ]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megassm-launch", description="Launch megassm training processes.")
    sub = p.add_subparsers(dest="mode", required=True)
    loc = sub.add_parser("local", help="torchrun on this machine")
    loc.add_argument("--nproc-per-node", type=int, default=1)
    loc.add_argument("--config", required=True)
    loc.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    loc.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nproc_per_node < 1:
        print("megassm-launch: --nproc-per-node must be >= 1", file=sys.stderr)
        return 2
    if not os.path.exists(args.config):
        print(f"megassm-launch: {args.config}: config file not found", file=sys.stderr)
        return 2
    cmd = torchrun_command(args.nproc_per_node, args.config, args.overrides)
    print(shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
