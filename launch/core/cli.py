"""`megassm-launch`: start training processes.

    megassm-launch local --nproc-per-node 1 --config configs/tiny.yaml [key=value ...] [--dry-run]
    megassm-launch slurm --nodes 4 --gpus-per-node 8 --config configs/recipes/hybrid-7b-4node.yaml \
        --time 24:00:00 --partition gpu [--launcher deepspeed] [--dry-run | --submit] [key=value ...]

`local` runs `torchrun --standalone` on this machine with the same command line a cluster job runs
(`python -m megassm.train --config FILE overrides`). `slurm` checks the config at the job's world size
(before anything is queued), writes RUN_DIR/launch/{job.sbatch, config.yaml, version.json} and prints the
script's path; `--submit` hands it to sbatch (launch/core/slurm.py has the script's design, docs/launch.md the recipes).

Both run the job's dry run first (`megassm-train --dry-run --gpu CARD` at the job's world size, in a subprocess:
launch/ imports no torch or trainer code) when the job runs on GPUs, and stop before writing or starting anything
when the trainer would refuse the layout or it does not fit the card (exit 2, the nearest layouts that fit named).
A job runs on GPUs unless train.device=cpu; under `local` with train.device=auto, when this machine has a GPU.
`--no-memory-check` makes a misfit a warning.

stdout carries the result only: `local --dry-run` the command, `local` what the training processes print (the
trainer's closing line), `slurm --dry-run` the script, `slurm` the script's path, `slurm --submit` the job id.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys

from . import slurm


def train_command(config: str, overrides: list[str]) -> list[str]:
    """The per-process training command that every launcher runs."""
    return ["-m", "megassm.train", "--config", config, *overrides]


def launch_env(nproc_per_node: int, environ=None) -> dict[str, str]:
    """What the launcher sets for the training processes, unless already set: OMP_NUM_THREADS (the machine's
    cores shared among its ranks; torchrun would otherwise set 1 with a warning banner) and
    TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (a failed or timed-out NCCL collective ends the rank: docs/launch.md)."""
    environ = os.environ if environ is None else environ
    want = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc_per_node)),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    return {k: v for k, v in want.items() if k not in environ}


def torchrun_command(nproc_per_node: int, config: str, overrides: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc_per_node}", *train_command(config, overrides),
    ]


# the cards of `megassm-train --dry-run --gpu` (megassm/train.py GPU_CHOICES; not imported: launch/ imports no
# trainer code, tests/test_layout_fit.py checks that they agree)
GPU_CHOICES = ("h100-80gb", "h200-141gb")


def _add_memory_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", choices=GPU_CHOICES, default="h100-80gb",
                   help="the card the job runs on: the layout must fit its memory by the dry run's estimate "
                   "(default h100-80gb)")
    p.add_argument("--no-memory-check", action="store_true",
                   help="launch a layout that does not fit the card by the estimate (a warning names it)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megassm-launch", description="Launch megassm training processes.")
    sub = p.add_subparsers(dest="mode", required=True)
    loc = sub.add_parser("local", help="torchrun on this machine")
    loc.add_argument("--nproc-per-node", type=int, default=1)
    loc.add_argument("--config", required=True)
    loc.add_argument("--dry-run", action="store_true", help="check, print the command, run nothing")
    _add_memory_options(loc)
    loc.add_argument("overrides", nargs="*", help="key=value config overrides")

    sl = sub.add_parser("slurm", help="write (and submit) an sbatch script: one launcher task per node")
    sl.add_argument("--nodes", type=int, required=True)
    sl.add_argument("--gpus-per-node", type=int, required=True)
    sl.add_argument("--config", required=True)
    sl.add_argument("--launcher", choices=("torchrun", "deepspeed"), default="torchrun")
    sl.add_argument("--run-dir", default=None, help="default: the config's run.dir (made absolute)")
    sl.add_argument("--job-name", default=None, help="default: the run directory's name")
    sl.add_argument("--time", default=None, help="HH:MM:SS or D-HH:MM:SS")
    sl.add_argument("--partition", default=None)
    sl.add_argument("--account", default=None)
    sl.add_argument("--cpus-per-task", type=int, default=None)
    sl.add_argument("--signal-lead", type=int, default=300,
                    help="seconds before the time limit at which SIGUSR1 asks for a checkpoint (default 300)")
    sl.add_argument("--port", type=int, default=29500, help="rendezvous port on the head node")
    sl.add_argument("--python", default="python3", help="the interpreter on the compute nodes")
    sl.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                    help="an extra #SBATCH line, e.g. --sbatch=--exclusive (repeatable)")
    _add_memory_options(sl)
    mode = sl.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="check, print the script; write nothing")
    mode.add_argument("--submit", action="store_true", help="run sbatch on the written script")
    sl.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p


def check_job(config: str, overrides: list[str], world: int, gpu: str, memory_check: bool,
              gpus_per_node: int = 0) -> int:
    """The job's dry run (`python -m megassm.train --dry-run`) at `world` ranks, in a subprocess: 0, or its exit
    code after relaying why (the trainer's layout refusal, or a layout that does not fit `gpu` with the nearest
    that fit). `gpus_per_node`: the node size, for the dry run's HSDP suggestions and bytes across nodes."""
    cmd = [sys.executable, "-m", "megassm.train", "--dry-run", "--gpu", gpu, "--config", config, *overrides,
           f"parallel.world_size={world}"]
    if not memory_check:
        cmd.insert(cmd.index("--config"), "--no-memory-check")
    if gpus_per_node:
        cmd.append(f"parallel.gpus_per_node={gpus_per_node}")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    verdict = [x[2:] for x in r.stdout.splitlines() if x.startswith("# memory check:")]
    if r.returncode == 0:
        for line in verdict[-1:]:
            print(f"megassm-launch: {line} (world size {world}, --gpu {gpu})", file=sys.stderr)
        sys.stderr.write(r.stderr)  # --no-memory-check's warning
        return 0
    print(f"megassm-launch: the job's dry run (world size {world}, --gpu {gpu}) refuses it; nothing was written or "
          "started:", file=sys.stderr)
    sys.stderr.write(r.stderr)
    return r.returncode


def runs_on_gpus(device: str, local: bool) -> tuple[bool, str]:
    """Whether the job runs on GPUs, and why not: train.device=cpu never; under `local` train.device=auto only
    where torch sees a GPU on this machine (imported here only, for that question); a SLURM job gets
    --gpus-per-node GPUs per node."""
    if device == "cpu":
        return False, "train.device=cpu: the job runs on CPUs"
    if device == "auto" and local:
        import torch

        if not torch.cuda.is_available():
            return False, "train.device=auto and no GPU is visible here: the job runs on CPUs"
    return True, ""


def _code_version() -> dict:
    """The megassm checkout a job runs: git commit and whether the tree had uncommitted changes."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # launch/core/cli.py

    def git(*a):
        r = subprocess.run(["git", "-C", here, *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    return {"git_commit": commit, "git_dirty": bool(git("status", "--porcelain")) if commit else None,
            "source": here}


def _write_atomic(path: str, text: str, mode: int | None = None) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)


def slurm_main(args) -> int:
    """Check the config at the job's world size, write RUN_DIR/launch/*, print (and maybe submit) the script."""
    from megassm.config import ConfigError, dump_config, load_config

    if args.nodes < 1 or args.gpus_per_node < 1:
        print("megassm-launch: --nodes and --gpus-per-node must be >= 1", file=sys.stderr)
        return 2
    world = args.nodes * args.gpus_per_node
    overrides = [o for o in args.overrides if not o.startswith(("parallel.world_size=", "run.resume="))]
    if args.run_dir:
        overrides.append(f"run.dir={os.path.abspath(args.run_dir)}")
    try:
        cfg = load_config(args.config, [*overrides, f"parallel.world_size={world}"])
        _check_data(cfg)
        if cfg.run.overwrite:  # the job runs with run.resume=auto, so that a requeue continues the run
            raise ConfigError("run.overwrite=true: a SLURM job resumes (run.resume=auto) so that its requeues "
                              "continue the run; move the earlier run out of run.dir yourself, or pick a new run.dir")
    except ConfigError as e:
        print(f"megassm-launch: config error at world size {world} ({args.nodes} nodes x {args.gpus_per_node} "
              f"GPUs): {e}", file=sys.stderr)
        return 2
    run_dir = os.path.abspath(cfg.run.dir)
    cfg.run.dir = run_dir
    job = slurm.SlurmJob(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, config=args.config, overrides=overrides,
        run_dir=run_dir, job_name=args.job_name or re.sub(r"[^\w.-]", "_", os.path.basename(run_dir)) or "megassm",
        time=args.time, partition=args.partition, account=args.account, cpus_per_task=args.cpus_per_task,
        signal_lead_s=args.signal_lead, port=args.port, launcher=args.launcher, python=args.python,
        extra_sbatch=args.sbatch)
    launch_dir = os.path.join(run_dir, "launch")
    # the job trains from the resolved config saved beside the script (a later edit of the original does not
    # change a requeued job); run.resume=auto: a fresh start, or the newest checkpoint after a requeue
    train_args = train_command(os.path.join(launch_dir, "config.yaml"), ["run.resume=auto"])
    try:
        script = slurm.batch_script(job, train_args)
    except ValueError as e:
        print(f"megassm-launch: {e}", file=sys.stderr)
        return 2
    gpus, why = runs_on_gpus(cfg.train.device, local=False)
    if gpus:  # the trainer's layout checks and the card's memory, before anything is written or queued
        code = check_job(args.config, overrides, world, args.gpu, not args.no_memory_check,
                         0 if cfg.parallel.gpus_per_node else args.gpus_per_node)
        if code:
            return code
    else:
        print(f"megassm-launch: memory check: none: {why}", file=sys.stderr)
    if args.dry_run:
        print(script, end="")
        return 0
    os.makedirs(launch_dir, exist_ok=True)
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    _write_atomic(os.path.join(launch_dir, "config.yaml"), dump_config(cfg))
    version = {**_code_version(), "command": ["megassm-launch", *sys.argv[1:]] if argv_is_cli() else None,
               "config": os.path.abspath(args.config), "overrides": overrides, "nodes": args.nodes,
               "gpus_per_node": args.gpus_per_node, "launcher": args.launcher,
               "gpu": args.gpu if gpus else None, "memory_check": gpus and not args.no_memory_check,
               "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    _write_atomic(os.path.join(launch_dir, "version.json"), json.dumps(version, indent=1) + "\n")
    path = os.path.join(launch_dir, "job.sbatch")
    _write_atomic(path, script, mode=0o755)
    print(script, end="", file=sys.stderr)
    print(f"# written: {path}", file=sys.stderr)
    if not args.submit:
        print(f"# submit with: sbatch {shlex.quote(path)}", file=sys.stderr)
        print(path)  # the result: the script's path
        return 0
    try:
        r = subprocess.run(["sbatch", "--parsable", path], capture_output=True, text=True)
    except FileNotFoundError:
        print("megassm-launch: sbatch not found on PATH (run --submit on a SLURM login node)", file=sys.stderr)
        return 2
    if r.returncode != 0:
        print(f"megassm-launch: sbatch failed ({r.returncode}): {r.stderr.strip()}", file=sys.stderr)
        return r.returncode
    job_id = r.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}; logs in {run_dir}/logs", file=sys.stderr)
    print(job_id)  # the result: the job id, as `sbatch --parsable` gives it
    return 0


def argv_is_cli() -> bool:
    return os.path.basename(sys.argv[0]) in ("megassm-launch", "cli.py")


def _check_data(cfg) -> None:
    """data.paths must name shards that exist (the login node sees the cluster's file system)."""
    from megassm.config import ConfigError
    from megassm.data_tools.indexed import shard_prefixes

    for prefix in cfg.data.paths:
        try:
            shard_prefixes(prefix)
        except FileNotFoundError as e:
            raise ConfigError(f"data.paths: {e}") from None


def local_check(args) -> int:
    """`local`: the config at the job's world size (--nproc-per-node), then, for a job on GPUs, its dry run."""
    from megassm.config import ConfigError, load_config

    world = args.nproc_per_node
    try:
        own = load_config(args.config, args.overrides, validate_config=False).parallel.world_size
        if own is not None and own != world:
            raise ConfigError(f"parallel.world_size={own}, but --nproc-per-node {world} starts {world} process(es): "
                              f"set --nproc-per-node {own}, or parallel.world_size={world}")
        cfg = load_config(args.config, [*args.overrides, f"parallel.world_size={world}"])
    except ConfigError as e:
        print(f"megassm-launch: config error at world size {world}: {e}", file=sys.stderr)
        return 2
    gpus, why = runs_on_gpus(cfg.train.device, local=True)
    if not gpus:
        print(f"megassm-launch: memory check: none: {why}", file=sys.stderr)
        return 0
    return check_job(args.config, args.overrides, world, args.gpu, not args.no_memory_check)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mode == "slurm":
        return slurm_main(args)
    if args.nproc_per_node < 1:
        print("megassm-launch: --nproc-per-node must be >= 1", file=sys.stderr)
        return 2
    if not os.path.exists(args.config):
        print(f"megassm-launch: {args.config}: config file not found", file=sys.stderr)
        return 2
    code = local_check(args)
    if code:
        return code
    cmd = torchrun_command(args.nproc_per_node, args.config, args.overrides)
    env = launch_env(args.nproc_per_node)
    line = " ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(cmd)])
    if args.dry_run:
        print(line)  # the result of a dry run: the command
        return 0
    # a log line: stdout is left to the training processes (the trainer's closing line)
    print(line, file=sys.stderr, flush=True)
    return subprocess.call(cmd, env={**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main())
