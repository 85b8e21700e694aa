"""`megassm-train` / `python -m megassm.train`: train a model from a YAML config with dotted overrides.

    megassm-train --config configs/tiny.yaml model.d_model=256 train.steps=50 run.dir=runs/x
    megassm-train --config configs/tiny.yaml --resume auto
    megassm-train --config configs/hybrid-7b.yaml --dry-run parallel.world_size=64 parallel.tp=2 parallel.pp=4
    megassm-train --config configs/hybrid-7b.yaml --dry-run --gpu h200-141gb parallel.world_size=4 parallel.tp=2
    megassm-train --config configs/tiny.yaml --print-config kernels.ssd_precision=split

Overrides and options may come in any order (`--resume auto train.steps=600` or the reverse). Results go to stdout
(the closing `megassm-train: done, N steps; run directory DIR`; the dry run's table and JSON line; the config of
--print-config); logs, the progress bar and errors to stderr.

The `kernels:` section becomes the kernels' MEGASSM_* variables at start-up, in each rank's process; a variable
that is set already wins (one log line names it), and run.dir/config.yaml records the values in effect and every
MEGASSM_* variable that was set (training/run_config.py apply_settings; docs/config.md "kernels").

Exit codes (megassm/training/failures.py; docs/reliability.md says what to do after each):
  0   done
  2   config or input error: the key, file, line or value is named; found before any compute, except a
      token id outside the vocabulary in a corpus too large to scan at start (found when read); with --dry-run
      also a layout the trainer refuses or that does not fit the --gpu card's memory (the nearest that fit named)
  3   non-finite loss; the message names the newest checkpoint that verifies
  4   I/O error: run.dir or checkpoints/ not writable, the disk is full or a file-size limit (ulimit -f) was hit;
      no half-written checkpoint is left
  5   run.dir is in use by another trainer (its lock names host and PID); nothing was written
  6   run.resume found checkpoints but none intact (each is named with what failed verification)
  7   loss spikes went on after train.spike_max_rollbacks rollbacks to the same checkpoint (or it no longer loads)
  99  (PREEMPT_EXIT_CODE) SIGUSR1 / SIGTERM / Ctrl-C made every rank checkpoint at the same step boundary and
      stop: "checkpointed, requeue me", resume with --resume auto (docs/launch.md)
  130 a second Ctrl-C: stopped at once, nothing saved since the last checkpoint
  1   an unexpected error (a traceback)
SIGUSR2 prints every thread's stack to stderr and training goes on (where a hung rank waits).
Rank 0 of the trainer that holds run.dir's lock records the code in run.dir/last_exit.json, which the SLURM
batch script of `megassm-launch slurm` reads to decide on a requeue (99 only). Failures found before the
lock is taken (a config that does not load, a layout refused, a run.dir in use, a fresh start in a run.dir
that holds an earlier run) write nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import signal
import sys
from types import SimpleNamespace

from megassm.config import ConfigError, dump_config, load_config, world_size
from megassm.training import preemption, runlock
from megassm.training.failures import (EXIT_ABORTED, EXIT_CONFIG, EXIT_IO, EXIT_LOCKED, EXIT_NO_CHECKPOINT,
                                       EXIT_NONFINITE, EXIT_OK, EXIT_SPIKE, describe_os_error, one_line)

EXIT_PREEMPTED = preemption.PREEMPT_EXIT_CODE  # 99: checkpointed, requeue me
# --gpu of the dry run: the keys of megassm/training/memory.py GPU_NAMES, spelled out for the parser (and in
# launch/core/cli.py, which imports no trainer code); tests/test_layout_fit.py checks that the three agree
GPU_CHOICES = ("h100-80gb", "h200-141gb")
DEFAULT_GPU = "h100-80gb"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megassm-train",
        description="Train a Mamba-2 / hybrid language model. Overrides are dotted key=value pairs "
        "after the options, e.g. model.d_model=256 train.steps=50 run.dir=runs/x (docs/config.md lists every key).",
    )
    p.add_argument("--config", required=True, help="YAML config file (see configs/)")
    p.add_argument("--resume", default=None, help="none | auto (newest complete checkpoint in run.dir) | PATH")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the layout, print the model size and a per-GPU memory estimate (table, then "
                   "one JSON line); builds models on the meta device only, never touches a GPU")
    p.add_argument("--gpu", choices=sorted(GPU_CHOICES), default=None,
                   help="with --dry-run: the card the job runs on, whose memory the layout must fit (default "
                   "h100-80gb); a layout that does not fit exits 2 and names the nearest ones that do")
    p.add_argument("--no-memory-check", action="store_true",
                   help="with --dry-run: a layout that does not fit the card is a warning, not a refusal")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as the run would save it (the kernels section after the "
                   "environment's overrides, the MEGASSM_* variables recorded) and exit; writes nothing, never "
                   "touches a GPU")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p


@contextlib.contextmanager
def _env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: str(v) for k, v in kv.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _dry_run_config(config: str, overrides: list[str]):
    """The config for a dry run, and notes: a layout can be checked before its data exists, so a config
    without data gets a stand-in source (noted), and data.paths that name no shards are noted, not fatal."""
    from megassm.config import validate
    from megassm.data_tools.indexed import shard_prefixes
    from megassm.training.run_config import apply_settings

    cfg = load_config(config, overrides, validate_config=False)
    notes = []
    if not cfg.data.paths and cfg.data.builtin is None:
        cfg.data.builtin = "stdlib"
        notes.append("no data.paths or data.builtin: a training run needs one (the dry run checked the layout "
                     "without data)")
    validate(cfg)
    apply_settings(cfg)  # the memory estimate reads the SSD's switches (models/mamba2.py)
    for prefix in cfg.data.paths:
        try:
            shard_prefixes(prefix)
        except FileNotFoundError as e:
            notes.append(f"data.paths: {e}")
    return cfg, notes


def dry_run(cfg, notes: list[str] = (), gpu: str = DEFAULT_GPU, memory_check: bool = True) -> int:
    """Check the config and layout, report model size and the per-GPU memory estimate without allocating
    weights or touching a GPU. Returns the exit code: 2 when the trainer would refuse the layout, or when it does
    not fit the memory of `gpu` (a GPU_CHOICES name) by the estimate; then the nearest layouts that fit are named
    (training/layouts.py). A job on CPUs (train.device=cpu) has no GPU memory to fit; `memory_check=False`
    (--no-memory-check) makes a misfit a warning."""
    import copy

    import torch

    from megassm.models import build_model
    from megassm.training import memory, traffic
    from megassm.training.flops import flops_per_sequence
    from megassm.training.trainer import check_supported

    vocab = cfg.model.vocab_size or 257  # byte tokenizer when the data decides the vocabulary
    with torch.device("meta"):
        model = build_model(cfg.model, vocab_size=vocab, device="meta")
    fl = flops_per_sequence(cfg.model, model.vocab_size_padded, cfg.train.seq_len)
    print(dump_config(cfg), end="")
    print(f"# blocks: {model.n_layers}  parameters: {model.num_parameters() / 1e6:.2f}M  "
          f"train FLOPs/token: {3 * fl['total'] / cfg.train.seq_len:.4g}")
    est = memory.estimate(cfg, vocab=vocab)
    print(memory.format_table(est))
    flows = traffic.step_flows(cfg, vocab=vocab)
    print(traffic.format_flows(cfg, flows))
    est["traffic"] = traffic.to_dict(flows)
    card = memory.GPU_NAMES[gpu]
    for w in [*notes, *memory.layout_warnings(cfg, est, gpu=card), *traffic.layout_warnings(cfg)]:
        print(f"# warning: {w}")
    refused = None
    target = copy.deepcopy(cfg)  # the layout as the launched job sees it: one process per rank, a GPU
    target.train.device, target.train.precision = "auto", "auto"
    try:
        with _env(WORLD_SIZE=world_size(cfg)):
            check_supported(target, device=torch.device("cuda"))
        if cfg.model.init_from:  # its layout and model config, as the trainer checks them (no weights read)
            from megassm.interop import sources

            sources.check_config(sources.open_source(cfg.model.init_from), cfg.model)
    except ConfigError as e:
        refused = str(e)
    fit, misfit = _memory_fit(cfg, est, card, vocab, memory_check)
    est["fit"] = fit
    print(f"# memory check: {fit['summary']}")
    print(memory.to_json(est))
    if refused:
        print(f"megassm-train: config error: the trainer would refuse this layout: {refused}", file=sys.stderr)
    if misfit:
        print("\n".join(misfit), file=sys.stderr)
    return EXIT_CONFIG if refused or (misfit and fit["checked"]) else EXIT_OK


def _memory_fit(cfg, est: dict, card: str, vocab: int, check: bool) -> tuple[dict, list[str]]:
    """The dry run's verdict on `card`'s memory: (the "fit" entry of its JSON line, the lines for stderr when the
    layout does not fit: the refusal, or with check=False the warning, then the nearest layouts that fit)."""
    from megassm.training import layouts, memory

    need = memory.needed_gib(cfg, est)
    have = memory.GPU_MEMORY_GIB[card]
    others = [c for c in memory.GPU_MEMORY_GIB if c != card and memory.fits(cfg, est, c)]
    fit = {"gpu": card, "gpu_gib": have, "needed_gib": round(need, 2), "reserve_factor": memory.reserve_factor(cfg),
           "fits": memory.fits(cfg, est, card), "checked": check and cfg.train.device != "cpu",
           "fits_other_gpus": others,
           "nearest": []}
    how = (f"{est['peak_per_gpu_gib']:.1f} GiB estimated per GPU, {need:.1f} GiB with the allocator's reserve "
           f"(x{fit['reserve_factor']:.2f} for parallel.engine={cfg.parallel.engine}) and "
           f"{memory.CONTEXT_GIB:.0f} GiB of CUDA context")
    if cfg.train.device == "cpu":
        fit["summary"] = f"none: train.device=cpu runs on CPUs ({how}, were it on GPUs)"
        return fit, []
    if fit["fits"]:
        fit["summary"] = f"fits {card} ({have} GiB): {how}"
        return fit, []
    fit["summary"] = f"does not fit {card} ({have} GiB): {how}"
    where = (f"; it fits {' and '.join(others)} (--gpu {_gpu_flag(others[0])})" if others else
             f"; neither {' nor '.join(memory.GPU_MEMORY_GIB)} holds it")
    if not check:
        return fit, [f"megassm-train: warning: --no-memory-check: the layout does not fit {card}: {how}, over its "
                     f"{have} GiB{where}; going on"]
    lines = [f"megassm-train: config error: the layout does not fit {card}: {how}, over its {have} GiB{where}"]
    found = layouts.nearest_layouts(cfg, card, vocab=vocab)
    fit["nearest"] = [f.to_dict() for f in found]
    if found:
        world = world_size(cfg)
        larger = found[0].world_size != world
        lines.append(f"megassm-train: the nearest layouts that fit {card}"
                     + (f" (nothing fits {world} GPU{'s' if world > 1 else ''}: these take more, by "
                        "parallel.world_size or the launcher's GPU count)" if larger else "")
                     + ", fewest changes first; add one to the command line:")
        width = max(len(" ".join(f.overrides)) for f in found)
        lines += [f"  {' '.join(f.overrides):<{width}}  # {f.peak_gib:.1f} GiB estimated, {f.needed_gib:.1f} needed"
                  for f in found]
    else:
        lines.append(f"megassm-train: no layout the dry run tries fits {card} (docs/launch.md \"A layout that does "
                     "not fit\" lists them); parallel.pp or parallel.cp, which it leaves as they are, may")
    lines.append("megassm-train: or check against another card (--gpu), or go on regardless (--no-memory-check)")
    return fit, lines


def _gpu_flag(card: str) -> str:
    from megassm.training.memory import GPU_NAMES

    return next(k for k, v in GPU_NAMES.items() if v == card)


def write_exit_status(run_dir: str, code: int, reason: str, trainer=None) -> None:
    """run_dir/last_exit.json (rank 0 of the trainer holding run_dir's lock): the exit code and where the run
    stands, for the SLURM batch script's requeue decision and for people. A file that cannot be written (a
    full disk) is reported on stderr, never raised."""
    if int(os.environ.get("RANK", "0")) != 0 or not runlock.holds(run_dir):
        return
    status = {
        "exit_code": code,
        "reason": reason,
        "step": getattr(trainer, "step", None),
        "checkpoint": getattr(trainer, "last_checkpoint", None),
        "signal": preemption.reason(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    path = os.path.join(run_dir, "last_exit.json")
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(status, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        print(f"megassm-train: could not write {path}: {describe_os_error(e)}", file=sys.stderr)
        with contextlib.suppress(OSError):
            os.remove(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # overrides before, between and after the options
    if not args.dry_run and (args.gpu or args.no_memory_check):
        parser.error("--gpu and --no-memory-check go with --dry-run (a training run uses the GPUs it finds)")
    if args.dry_run and args.print_config:
        parser.error("--print-config and --dry-run: one of them (the dry run prints the resolved config too)")
    from megassm.training.logs import setup_logging

    setup_logging(args.log_level)  # rank 0 speaks, the other ranks warn; third-party INFO quiet
    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"run.resume={args.resume}")
    try:  # the kernels' environment switches (MEGASSM_KERNELS, MEGASSM_SSD_*): before any model or GPU work
        from megassm.kernels import env as kernel_env

        kernel_env.check()
    except ValueError as e:
        print(f"megassm-train: config error: environment: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_config:
        return print_config(args.config, overrides)
    if args.dry_run:
        try:
            cfg, notes = _dry_run_config(args.config, overrides)
            return dry_run(cfg, notes, gpu=args.gpu or DEFAULT_GPU, memory_check=not args.no_memory_check)
        except ConfigError as e:
            print(f"megassm-train: config error: {e}", file=sys.stderr)
            return EXIT_CONFIG
    preemption.reset()
    preemption.install()  # before anything slow: a preemption signal during setup must not kill the process
    if hasattr(signal, "SIGXFSZ"):  # a file-size limit (ulimit -f): write() fails with EFBIG, which a save reports
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as exit 4, instead of the signal killing the process
    preemption.install_stack_dump()  # kill -USR2: every thread's stack on stderr (docs/reliability.md)
    try:
        return _train(args.config, overrides)
    finally:
        preemption.uninstall()
        preemption.uninstall_stack_dump()


def print_config(config: str, overrides: list[str]) -> int:
    """--print-config: the resolved config on stdout as run.dir/config.yaml would hold it (validated, the kernels
    section after the environment's overrides, the MEGASSM_* variables recorded); nothing written or set."""
    from megassm.training.run_config import resolve_settings

    try:
        cfg = load_config(config, overrides)
        overrides_by_env = resolve_settings(cfg)
    except ConfigError as e:
        print(f"megassm-train: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if overrides_by_env:
        print(f"megassm-train: the environment overrides the config: {'; '.join(overrides_by_env)}", file=sys.stderr)
    print(dump_config(cfg), end="", flush=True)
    return EXIT_OK


def _train(config: str, overrides: list[str]) -> int:
    from megassm.training.run_config import apply_settings

    try:
        cfg = load_config(config, overrides)
        apply_settings(cfg)  # this rank's kernel variables, before the kernels are imported (the Trainer again)
    except ConfigError as e:
        print(f"megassm-train: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from megassm.training.trainer import Trainer

    trainer, finished, code = None, False, None
    try:
        trainer = Trainer(cfg)
        trainer.fit()
        finished = True  # every rank gets here (a preemption stop is agreed by all ranks)
    except BaseException as e:
        code, message = _failure(e, trainer)
        if code is None:  # unforeseen: the traceback follows; last_exit.json still says that the run failed
            write_exit_status(cfg.run.dir, 1, f"unexpected error: {type(e).__name__}: {one_line(e)}", trainer)
            raise
        message = " ".join(message.split())  # one line, whatever the exception's text held
        print(f"megassm-train: {message}", file=sys.stderr)
        write_exit_status(cfg.run.dir, code, message, trainer)
        return code
    finally:
        from megassm.parallel.state import destroy

        # what the exit needs, then the trainer goes: its model, pipeline stages, DDP reducer and optimizer hold
        # process groups (some in reference cycles), and destroy() collects them before the groups themselves,
        # instead of leaving them to interpreter exit
        trainer = SimpleNamespace(preempted=getattr(trainer, "preempted", False), step=getattr(trainer, "step", None),
                                  last_checkpoint=getattr(trainer, "last_checkpoint", None))
        if finished:  # before the final barrier: once one rank has left with a non-zero code, torchrun SIGTERMs
            code = _report_finish(cfg.run.dir, trainer)  # the others, so rank 0's last_exit.json is written first
        runlock.release(cfg.run.dir)  # after last_exit.json: the next trainer finds this run's record complete
        destroy(barrier=finished)  # process groups of a torchrun launch (no-op for one process)
    return code


def _failure(e: BaseException, trainer) -> tuple[int | None, str]:
    """(exit code, one-line message) of a failure a user can cause; (None, "") for anything else."""
    from megassm.data_tools.dataset import TokenIdError
    from megassm.training.checkpoint import CheckpointDamagedError
    from megassm.training.guards import SpikeStopError
    from megassm.training.trainer import NonFiniteLossError

    if isinstance(e, runlock.RunLockedError):
        return EXIT_LOCKED, str(e)
    if isinstance(e, NonFiniteLossError):
        return EXIT_NONFINITE, str(e)
    if isinstance(e, SpikeStopError):
        return EXIT_SPIKE, str(e)
    if isinstance(e, CheckpointDamagedError):
        return EXIT_NO_CHECKPOINT, str(e)
    if isinstance(e, ConfigError):
        return EXIT_CONFIG, f"config error: {e}"
    if isinstance(e, TokenIdError):
        return EXIT_CONFIG, f"data error: {e}"
    if isinstance(e, OSError):
        return EXIT_IO, (f"I/O error: {describe_os_error(e)}; free space, raise the file-size limit or fix the "
                         "permissions, then resume with --resume auto")
    if isinstance(e, KeyboardInterrupt):
        where = getattr(trainer, "last_checkpoint", None) or "the start (no checkpoint)"
        return EXIT_ABORTED, f"aborted by a second Ctrl-C at step {getattr(trainer, 'step', 0)}; nothing saved since {where}"
    return None, ""


def _report_finish(run_dir: str, trainer) -> int:
    """The exit code of a run every rank finished (done, or stopped at an agreed preemption step), its
    last_exit.json (rank 0) and its closing line."""
    speak = int(os.environ.get("RANK", "0")) == 0  # one closing line per job
    if trainer.preempted:
        write_exit_status(run_dir, EXIT_PREEMPTED, "preempted: checkpointed, requeue me", trainer)
        if speak:
            print(f"megassm-train: preempted ({preemption.reason() or 'signal on another rank'}) at step "
                  f"{trainer.step}, checkpoint {trainer.last_checkpoint}; exit {EXIT_PREEMPTED}: resume with "
                  "--resume auto", file=sys.stderr)
        return EXIT_PREEMPTED
    write_exit_status(run_dir, EXIT_OK, "done", trainer)
    if speak:
        # the result, on stdout (logs and progress are on stderr): what a script reads
        print(f"megassm-train: done, {trainer.step} steps; run directory {run_dir}", flush=True)
    return EXIT_OK


def cli() -> None:
    """The `megassm-train` console script and `python -m megassm.train`: main(), then the exit. A rank of a
    multi-process run leaves without interpreter finalization (os._exit after flushing logs and streams; its
    files are closed and its process groups destroyed by then): the gloo teardown during finalization now and
    then aborted a finished rank ("terminate called without an active exception", SIGABRT), which turned a run
    that had completed, checkpoints and last_exit.json written, into a failed launch."""
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()
