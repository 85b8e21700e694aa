"""The training loop: one loop for every scale.

    Trainer(cfg).fit()

CPU, one GPU with bf16 autocast, or one process per rank under torchrun. The parallel plans (TP/SP -> CP ->
PP -> activation checkpointing -> the data-parallel engine) are applied to the model from outside by their own
modules (megassm/parallel); what a layout may combine is checked first (checks.py), the run's identity in its
config is run_config.py's.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass

import torch

from megassm.config import Config, ConfigError, data_parallel_size, in_run_dir
from megassm.models.coffee import deer_stats
from megassm.parallel import runtime as prt
from megassm.parallel.engines import build_engine
from megassm.training import checkpoint as ckpt
from megassm.training import consensus, faults, preemption, runlock
from megassm.training.checkpoint.folder import PREVIOUS_PREFIX, earlier_run, move_aside
from megassm.training.checkpoint.manager import CheckpointManager
from megassm.training.failures import RunIOError, describe_os_error
from megassm.training.guards import SpikeGuard, SpikeStopError, StragglerReport
from megassm.training.flops import flops_per_sequence, mfu, peak_flops_for
from megassm.training.metrics import MetricsLogger, ProgressBar, memory_scalars
from megassm.training.wandb_sink import wandb_settings
from megassm.training.optim import LRScheduler, build_optimizer
from megassm.training.checks import autocast_dtype, check_supported, pick_device
from megassm.training.run_config import apply_settings, write_resolved_config
from megassm.training.startup import materialize_held, peak_host_bytes

log = logging.getLogger("megassm.train")


def _process_age() -> float | None:
    """Seconds since this process started (Linux /proc), or None where that is not known."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return time.time() - (boot + start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss or gradient norm; the message names the last good checkpoint."""


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    step_time: float
    data_time: float


class Trainer:
    def __init__(self, cfg: Config):
        check_supported(cfg)
        apply_settings(cfg)  # kernels.* into this rank's environment before any kernel runs; cfg: values in effect
        self.cfg = cfg
        # model.init_from: its layout and config checked before any device or rank is set up (weights come later)
        init_source = None
        if cfg.model.init_from:
            from megassm.interop import sources as init_sources

            init_source = init_sources.open_source(cfg.model.init_from)
            init_sources.check_config(init_source, cfg.model)
        self.device = pick_device(cfg)
        # multi-process: torch.distributed from torchrun's env, groups from megatron-core (megassm.parallel)
        self.groups, self.device = prt.setup(cfg, self.device)
        self.amp_dtype = autocast_dtype(cfg, self.device)
        if cfg.train.cuda_graph and self.device.type != "cuda":  # the layout was checked above; this run's device
            raise ConfigError(f"train.cuda_graph=true needs a CUDA device; this run uses {self.device}")
        g = self.groups
        for name, size, group in (("tp", g.tp, g.tp_group), ("cp", g.cp, g.cp_group)):
            if cfg.train.cuda_graph and size > 1 and prt.backend(group) != "nccl":
                raise ConfigError(f"train.cuda_graph=true with parallel.{name}={size} captures the {name.upper()} "
                                  f"group's collectives, which needs NCCL; its backend is {prt.backend(group)}")
        self.run_dir = cfg.run.dir
        self.dp = data_parallel_size(cfg)
        self.accum = cfg.train.global_batch // (cfg.train.micro_batch * self.dp)
        self.tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        if cfg.train.bptt:  # one optimizer step consumes train.bptt_windows consecutive windows per row
            self.tokens_per_step *= cfg.train.bptt_windows
        self.step = 0
        self._claim_run_dir()  # before any rank writes into run.dir
        preemption.write_pid_file(self.run_dir)
        torch.manual_seed(cfg.train.seed)

        from megassm.data_tools.loader import build_data
        from megassm.models import build_model

        try:
            self.data = build_data(
                cfg.data,
                seq_len=cfg.train.seq_len,
                micro_batch=cfg.train.micro_batch,
                global_batch=cfg.train.global_batch,
                dp_rank=self.groups.dp_rank,
                dp_size=self.dp,
                seed=cfg.train.seed,
                bptt=cfg.train.bptt,
            )
        except (ValueError, OSError) as e:  # missing/corrupt shards, bad blend: the message names the file
            raise ConfigError(f"data: {e}") from e
        if cfg.model.vocab_size is not None and self.data.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's vocabulary "
                f"({self.data.vocab_size}, from its tokenizer): token ids would fall outside the embedding"
            )
        try:  # the ids themselves, whatever the manifests say
            self.data.check_token_ids(cfg.model.vocab_size or self.data.vocab_size)
        except ValueError as e:
            raise ConfigError(f"data: {e}") from e
        # shapes only (meta); the plans cut it there, and each rank then allocates only what it holds and fills it
        # with the canonical weights (training/startup.py): TP-local pieces, PP stages, and under FSDP2 the shards,
        # so no device ever holds the whole model
        model = build_model(cfg.model, vocab_size=self.data.vocab_size, device="meta")
        n_params = model.num_parameters()  # canonical count, before any sharding or pipeline split
        init_state = None
        if init_source is not None:  # every rank reads the canonical weights (a resume replaces them later)
            init_state = init_sources.load_state(init_source, model)
            log.info("model.init_from: initial weights from %s (%s layout)", init_source.where, init_source.kind)
        model = prt.split_stages(model, self.groups, cfg)  # PP: this rank's stages
        self.model = prt.prepare_model(model, self.groups, cfg)  # TP/SP, CP, PP plans, activation checkpointing
        if cfg.train.compile:  # each block's forward compiled; the module tree and parameter names unchanged
            from megassm.training.compile import compile_blocks

            compile_blocks(self.model)
        if cfg.train.loss_chunk_tokens:  # head + loss in checkpointed chunks (models/lm.py head_loss)
            self.model.loss_chunk_tokens = cfg.train.loss_chunk_tokens
        if cfg.train.fp8:  # the blocks' Linears in FP8 (training/fp8.py); before the engine wraps the model
            from megassm.training.fp8 import apply_fp8

            apply_fp8(self.model)
        # FSDP2 shards the meta model and the weights are filled in after it (its DTensor shards); the other
        # engines wrap real tensors (DDP broadcasts them, ZeRO-1 re-points them into flat buffers, DeepSpeed copies)
        shard_first = cfg.parallel.engine == "fsdp2" and self.dp > 1
        # PP: no group holds exactly the ranks of one stage, so each rank draws its stages itself
        fill = dict(device=self.device, groups=self.groups, seed=cfg.train.seed, state=init_state,
                    collective=self.groups.pp == 1)
        if not shard_first:
            materialize_held(self.model, **fill)
        self.weight_cache = None  # train.cast_weights_once / train.fp8: weight copies cast once per step
        if cfg.train.fp8:
            from megassm.training.fp8 import FP8WeightCache

            if cfg.parallel.engine == "ddp" or self.dp == 1:  # whole fp32 weights on every rank
                self.weight_cache = FP8WeightCache(self.model)
        elif cfg.train.cast_weights_once:
            from megassm.training.weight_cache import WeightCache

            self.weight_cache = WeightCache(self.model)
        # the data-parallel engine last (DDP / FSDP2 / DeepSpeed ZeRO); it owns the optimizer step
        self.engine = build_engine(cfg, self.model, self.groups, self.device, bf16=self.amp_dtype is torch.bfloat16)
        if shard_first:
            materialize_held(self.model, **fill)
        del init_state, fill
        self.startup_memory = {"startup/peak_host_gib": peak_host_bytes() / 2 ** 30}
        if self.device.type == "cuda":
            self.startup_memory["startup/peak_device_gib"] = torch.cuda.max_memory_allocated(self.device) / 2 ** 30
        self.optimizer = self.engine.make_optimizer(lambda: build_optimizer(
            self.model.param_groups(cfg.optim.weight_decay), cfg.optim, self.device.type))
        self.scheduler = LRScheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.graphed = None  # train.cuda_graph: each micro-batch is one graph replay (training/cuda_graph.py)
        if cfg.train.cuda_graph:
            from megassm.training.cuda_graph import GraphedMicroBatch

            # no host reads in the forward: attention builds its document mask on the device for every batch
            # (models/lm.py); evaluation, eager, takes the same path
            self.model.capture_safe = True
            # TP / CP: their collectives are captured with the rest of the micro-batch (training/cuda_graph.py)
            # kept_grads: the distributed optimizer's gradients are its buffer's views, never freed (distopt.py)
            self.graphed = GraphedMicroBatch(list(self.model.parameters()), self._forward_backward,
                                             collectives=self.groups.tp > 1 or self.groups.cp > 1,
                                             kept_grads=not self.engine.grads_to_none)
        self.carrier = None  # BPTT: the rows' recurrent states between windows (training/bptt.py)
        if cfg.train.bptt:
            from megassm.training.bptt import StateCarrier

            self.carrier = StateCarrier(self.model, cfg.train.micro_batch, self.accum,
                                        cfg.train.bptt_windows, self.device, groups=self.groups)

        vocab_padded = self.model.vocab_size_padded
        fl = flops_per_sequence(cfg.model, vocab_padded, cfg.train.seq_len)
        self.train_flops_per_token = 3.0 * fl["total"] / cfg.train.seq_len
        self.peak_flops = peak_flops_for(self.device)
        if self.peak_flops:  # MFU of the whole job: tokens/s are global
            self.peak_flops *= self.groups.world_size
        self.n_params = n_params

        # long-run guards (training/guards.py): the spike guard's window is part of a checkpoint, so before the resume
        self.guard = SpikeGuard(cfg.train, self.groups, self.device)
        self.straggler = StragglerReport(cfg, self.groups, self.device, self.accum)
        self._fault_scale = 1.0  # the fault tests' loss spike (training/faults.py): 1 unless MEGASSM_FAULT says
        # when to save, resume, roll back, and the checkpoint a failure names (training/checkpoint/manager.py)
        self.checkpoints = CheckpointManager(cfg, self.groups, model=self.model, optimizer=self.optimizer,
                                             engine=self.engine, scheduler=self.scheduler, data=self.data,
                                             guard=self.guard, carrier=self.carrier,
                                             tokens_per_step=self.tokens_per_step)
        resume_path, self.step = self.checkpoints.restore()
        if prt.is_rank0(self.groups):  # only once the run is accepted: a refused config never replaces the run's
            write_resolved_config(cfg, self.run_dir)

        # resume_step: lines a crashed run wrote after this checkpoint are superseded, not repeated; a resume that
        # found no checkpoint to load starts at step 0, so every line an earlier attempt logged is superseded
        resuming = resume_path is not None or str(cfg.run.resume).strip().lower() not in ("", "none")
        self.metrics = MetricsLogger(self.run_dir, tensorboard=cfg.run.tensorboard, rank=self.groups.rank,
                                     resume_step=self.step if resuming else None,
                                     wandb=wandb_settings(cfg))  # rank 0 only: MetricsLogger
        log.info(
            "model: %s blocks '%s', %.2fM parameters, vocab %d (padded %d); device %s, %s; "
            "global batch %d = micro %d x accumulation %d x dp %d; %.3g train FLOPs/token",
            self.model.n_layers, cfg.model.pattern, self.n_params / 1e6, self.data.vocab_size, vocab_padded,
            self.device, "bf16 autocast" if self.amp_dtype else "fp32", cfg.train.global_batch,
            cfg.train.micro_batch, self.accum, self.dp, self.train_flops_per_token,
        )
        self.startup_s = _process_age()  # launch to a ready model (logged with the first step)
        # the clock at the last step's host sync (train_step): a step is timed sync to sync, so the GPU tail of one
        # step (clipping, AdamW) overlaps the host's start of the next; None after anything else ran in between
        self._last_sync: float | None = None

    @property
    def last_checkpoint(self) -> str | None:
        """The checkpoint this run last saved or loaded: what a stop names (megassm.train, last_exit.json)."""
        return self.checkpoints.last

    # ------------------------------------------------------------------------------------------------
    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _to_device(self, batch: dict) -> dict:
        nb = self.device.type == "cuda"
        batch = prt.local_batch(batch, self.groups)  # CP: this rank's slice of every row
        return {k: v.to(self.device, non_blocking=nb) for k, v in batch.items()}

    def train_step(self) -> StepResult:
        """One optimizer step over `accum` micro-batches."""
        t0 = time.perf_counter()
        self.straggler.begin(self.step + 1)
        self._fault_scale = faults.loss_scale(self.data, self.cfg.train.global_batch)
        lr = self.scheduler.step_to(self.step)
        self.model.train()
        if self.weight_cache is not None:  # the weights as the last optimizer step (or a load) left them
            self.weight_cache.refresh()
        loss_sum = torch.zeros((), device=self.device)
        if self.carrier is not None:  # BPTT: states carried across windows, K windows per step (bptt.py)
            data_time = self.carrier.train_step(self, loss_sum)
        else:
            data_time = self._accumulate_pipeline(loss_sum) if self.groups.pp > 1 else self._accumulate(loss_sum)
        # TP partial grads summed, tied embeddings (PP), CP sum, then what the engine leaves to reduce over DP
        prt.finish_grads(self.model, self.groups, self.engine)
        loss_sum = prt.mean_over_dp(loss_sum, self.groups)
        loss = (loss_sum / self.accum).item()  # the step's first host sync: its micro-batches are done
        t_sync = time.perf_counter()

        def check(grad_norm: float) -> bool:  # False: the spike guard declines the step (training/guards.py)
            if not math.isfinite(loss) or not math.isfinite(grad_norm):
                raise NonFiniteLossError(self._non_finite_message(loss, grad_norm))
            return self.guard.judge(self.step + 1, loss, grad_norm, checkpoint=self.checkpoints.last,
                                    declines=self.engine.declines_steps)

        grad_norm = self.engine.clip_and_step(self.cfg.train.grad_clip, check)  # clip, check, step, zero
        # no synchronize here: the optimizer's kernels run while the host starts the next step (its data, the
        # weight casts, the first graph replay), where a sync left the GPU idle (2.8-8% of a graphed step,
        # docs/benchmarks.md). The step's time is sync to sync: the previous step's tail is in it, this one's in
        # the next: every second of wall time is counted once.
        start, self._last_sync = (t0 if self._last_sync is None else self._last_sync), t_sync
        return StepResult(loss, grad_norm, lr, self.tokens_per_step, t_sync - start, data_time)

    def _accumulate(self, loss_sum: torch.Tensor) -> float:
        """Forward/backward over this step's `accum` micro-batches, adding their losses into loss_sum.
        Returns the seconds spent waiting for data."""
        data_time = 0.0
        run = self._forward_backward
        if self.graphed is not None:
            self.graphed.begin_step()
            run = self.graphed
        for i in range(self.accum):
            td = time.perf_counter()
            batch = self._to_device(self.data.next_batch())
            data_time += time.perf_counter() - td
            # DDP: no_sync until the last; train.cuda_graph: the replay is what the straggler report times
            with self.engine.micro_batch(last=i == self.accum - 1), self.straggler.replay():
                loss_sum += run(batch)
        return data_time

    def _forward_backward(self, batch: dict) -> torch.Tensor:
        """One micro-batch's forward and backward (gradients accumulate); returns its loss, detached."""
        with self._autocast(), self.straggler.forward():  # timed on the straggler report's steps
            faults.in_forward()  # the fault tests' straggler: inert unless MEGASSM_FAULT is set
            out = self.engine.forward(batch["tokens"], seq_idx=batch["seq_idx"], labels=batch["labels"])
        loss = out.loss if self._fault_scale == 1.0 else out.loss * self._fault_scale  # the fault tests' spike
        self.engine.backward(loss, self.accum)
        return loss.detach()

    def _accumulate_pipeline(self, loss_sum: torch.Tensor) -> float:
        """PP: the step's `accum` micro-batches through the pipeline schedule (1F1B); every rank gets the
        last stage's loss sum. Returns the seconds spent waiting for data."""
        td = time.perf_counter()
        batches = [self._to_device(self.data.next_batch()) for _ in range(self.accum)]
        data_time = time.perf_counter() - td
        loss_sum += prt.pipeline_step(self.model, batches, self._autocast)
        return data_time

    def _non_finite_message(self, loss: float, grad_norm: float) -> str:
        where = self.checkpoints.last_good_note()
        return f"non-finite loss {loss} (grad norm {grad_norm}) at step {self.step + 1}; training stopped; {where}"

    def eval_samples(self) -> int:
        """Samples in the held-out set: train.eval_tokens rounded up to whole samples of seq_len tokens."""
        return -(-self.cfg.train.eval_tokens // self.cfg.train.seq_len)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss: the token-weighted mean cross-entropy over the held-out set (eval_samples()), the
        same tokens and the same mean for every layout (DP, TP, PP at any micro-batch count, CP)."""
        self._last_sync = None  # the next step is timed from its own start, not from the last step
        self.model.eval()
        if self.weight_cache is not None:  # the copies still hold the weights before the last step
            self.weight_cache.refresh()
        host = list(self.data.eval_batches(self.eval_samples()))
        # labelled tokens per micro-batch, counted on the whole rows (CP ranks hold slices; their loss is the
        # mean over the whole rows already)
        counts = [int((b["labels"] != -100).sum()) for b in host]
        batches = [self._to_device(b) for b in host]
        total = 0.0
        if batches and self.groups.pp > 1:  # all validation batches through the pipeline at once
            losses = prt.pipeline_eval(self.model, batches, self._autocast).double().cpu().tolist()
            total = sum(loss * c for loss, c in zip(losses, counts))
        else:
            for batch, c in zip(batches, counts):
                with self._autocast():
                    out = self.model(batch["tokens"], seq_idx=batch["seq_idx"], labels=batch["labels"])
                total += out.loss.double().item() * c
        self.model.train()
        self.engine.release()  # FSDP2: weights the evaluation gathered (parallel/fsdp2.py)
        summed = prt.sum_over_dp(torch.tensor([total, float(sum(counts))], dtype=torch.float64, device=self.device),
                                 self.groups)
        loss_sum, n_tokens = (float(x) for x in summed.cpu())
        if n_tokens == 0:
            return {}
        val = loss_sum / n_tokens
        return {"loss/val": val, "loss/val_ppl": math.exp(min(val, 50.0))}

    def _claim_run_dir(self) -> None:
        """Rank 0, before any rank writes into run.dir: refuse a live trainer's directory and a fresh start over an
        earlier run (both found by reading only, so a refusal changes nothing there), take the lock (runlock.py),
        move the earlier run aside under run.overwrite=true, remove what crashed runs left (temp checkpoints, PID
        files) and check that checkpoints can be written. Every rank learns the outcome and raises the same error
        (RunLockedError, ConfigError, RunIOError)."""
        error = None
        if prt.is_rank0(self.groups):
            try:
                runlock.refuse_if_held(self.run_dir, stale_after_s=self.cfg.run.lock_stale_s)
                self._refuse_earlier_run()
                runlock.acquire(self.run_dir, stale_after_s=self.cfg.run.lock_stale_s)
                if self.cfg.run.overwrite:
                    self._move_earlier_run_aside()
                for done in ckpt.clean_temp_dirs(self.run_dir):
                    log.warning("%s: %s", os.path.join(self.run_dir, ckpt.CHECKPOINTS), done)
                preemption.clear_pid_files(self.run_dir)
                ckpt.check_writable(self.run_dir)
            except (runlock.RunLockedError, RunIOError, ConfigError) as e:
                error = e
            except OSError as e:
                error = RunIOError(f"run.dir {self.run_dir}: {describe_os_error(e)}")
        error = consensus.agree_error(error)
        if error is not None:
            raise error
        # it acted once, here: config.yaml and the checkpoints record false, so a run started again from them
        # (--config RUN/config.yaml --resume auto) continues this run instead of moving it aside
        self.cfg.run.overwrite = False

    def _refuse_earlier_run(self) -> None:
        """ConfigError when this run would start fresh in a run.dir that holds an earlier run (checkpoint/folder.py
        earlier_run): run.resume=none (the default, or set) or a checkpoint of another run, without
        run.overwrite. Its checkpoints would be pruned by this run's run.keep_last and their metrics mixed."""
        r = self.cfg.run
        resume = str(r.resume).strip()
        fresh = resume.lower() in ("", "none")
        if r.overwrite or resume.lower() == "auto" or (not fresh and in_run_dir(resume, self.run_dir)):
            return  # moved aside once the lock is held, or this run.dir's own run continues
        what = earlier_run(self.run_dir)
        if what is None:
            return
        aside = os.path.join(self.run_dir, PREVIOUS_PREFIX + "<UTC time>")
        if fresh:
            raise ConfigError(f"run.dir {self.run_dir} holds an earlier run ({what}) and run.resume is none: continue "
                              f"it with --resume auto, start this run in another run.dir, or set run.overwrite=true "
                              f"to move the earlier run aside into {aside}/ and start at step 0")
        raise ConfigError(f"run.dir {self.run_dir} holds an earlier run ({what}) and run.resume={resume} is a "
                          "checkpoint of another run: resuming it there would mix the two runs' checkpoints and "
                          f"metrics. Resume it in another run.dir, or set run.overwrite=true to move the earlier run "
                          f"aside into {aside}/ first")

    def _move_earlier_run_aside(self) -> None:
        """run.overwrite=true, holding the lock: the earlier run (if any) into run.dir/previous-<UTC time>/."""
        what = earlier_run(self.run_dir)
        if what is None:
            log.info("run.overwrite=true: %s holds no earlier run; nothing moved aside", self.run_dir)
            return
        dest = move_aside(self.run_dir, keep=(runlock.LOCK_NAME,))
        log.warning("run.overwrite=true: moved the earlier run in %s (%s) aside into %s; this run starts at step 0",
                    self.run_dir, what, dest)

    def close(self) -> None:
        """Give the run directory back (rank 0's lock). megassm.train does it after writing last_exit.json."""
        runlock.release(self.run_dir)

    # ------------------------------------------------------------------------------------------------
    def _preempt(self) -> None:
        """Checkpoint (unless this step's checkpoint exists already) and mark the run preempted: megassm.train
        then exits with preemption.PREEMPT_EXIT_CODE (docs/launch.md)."""
        path = self.checkpoints.save_now(self.step)
        self.preempted = True
        log.warning("preempted (%s) at step %d: checkpoint %s", preemption.reason() or "signal on another rank",
                    self.step, path)

    def _rollback(self) -> None:
        """train.spike_action=rollback after a spike: the last checkpoint back (model, optimizer, scheduler, RNG,
        BPTT states, the guard's window) with the data position kept past the spiking step's batches, so they
        are not replayed; the metrics logged after the checkpoint's step are dropped, as on a resume."""
        spike, counters = self.guard.pending, self.guard.counters()
        path, problems, step = self.checkpoints.roll_back()
        if problems:
            raise SpikeStopError(f"spike at step {spike.step}: {spike.what}; cannot roll back, checkpoint {path} is "
                                 f"damaged: {'; '.join(problems)}")
        self.step = step
        self.guard.rolled_back(spike, self.step, path, counters)
        self.straggler.restart()
        self.metrics.close()
        self.metrics = MetricsLogger(self.run_dir, tensorboard=self.cfg.run.tensorboard, rank=self.groups.rank,
                                     resume_step=self.step,
                                     wandb=wandb_settings(self.cfg))
        self._last_sync = None

    def fit(self) -> list[float]:
        """Train to cfg.train.steps. Returns the per-step training losses of this invocation."""
        cfg = self.cfg
        losses: list[float] = []
        self.preempted = False  # set when a preemption signal stopped the loop (megassm.train exits 99)
        self._last_sync = None  # the first step of this invocation is timed from its own start
        bar = ProgressBar(cfg.train.steps, self.step, enabled=cfg.run.progress and prt.is_rank0(self.groups))
        window_tokens, window_time, window_data = 0, 0.0, 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            while self.step < cfg.train.steps:
                if preemption.agreed_stop(self.device):  # SIGUSR1/SIGTERM on any rank: every rank stops here
                    self._preempt()
                    break
                faults.at_step(self.step + 1)  # the fault tests' hook: inert unless MEGASSM_FAULT is set
                if self.step + 1 == cfg.run.profile_step:  # where the step's GPU time goes (training/profiling.py)
                    from megassm.training.profiling import StepProfiler

                    self._last_sync = None  # timed from its own start, inside the profiler (which syncs first)
                    with StepProfiler(self.run_dir, self.step + 1, self.groups.rank, cfg.run.profile_trace) as sp:
                        r = self.train_step()
                    sp.write()
                    self._last_sync = None  # the profiler's teardown is not the next step's time
                else:
                    r = self.train_step()
                if self.guard.rollback_due:  # a spike under train.spike_action=rollback (training/guards.py)
                    self._rollback()
                    continue
                self.step += 1
                losses.append(r.loss)
                window_tokens += r.tokens
                window_time += r.step_time
                window_data += r.data_time
                tps = r.tokens / r.step_time
                bar.update(self.step, loss=r.loss, tokens_per_s=tps)
                if len(losses) == 1:  # start-up cost of this invocation: process start to model ready, step 1
                    self.metrics.log(self.step, {"time/startup_s": self.startup_s, "time/first_step_s": r.step_time,
                                                 **self.startup_memory})
                    if self.device.type == "cuda":  # the peaks logged from now on are the steady state's
                        torch.cuda.reset_peak_memory_stats(self.device)

                straggler = self.straggler.report(self.step, r.data_time)  # collective on its report steps
                if self.step % cfg.train.log_interval == 0 or self.step == cfg.train.steps:
                    w_tps = window_tokens / max(window_time, 1e-9)
                    scalars = {
                        "loss/train": r.loss,
                        "optim/lr": r.lr,
                        "optim/grad_norm": r.grad_norm,
                        "throughput/tokens_per_s": w_tps,
                        **memory_scalars(self.device),
                        "time/data_wait_pct": 100.0 * window_data / max(window_time, 1e-9),
                        **deer_stats(self.model),  # COFFEE layers: Newton solves of the last forward
                        **self.guard.scalars(), **straggler,
                    }
                    if self.peak_flops:
                        scalars["throughput/mfu"] = mfu(w_tps, self.train_flops_per_token, self.peak_flops)
                    self.metrics.log(self.step, scalars)
                    window_tokens, window_time, window_data = 0, 0.0, 0.0
                elif straggler:
                    self.metrics.log(self.step, straggler)

                if cfg.train.eval_interval and (
                    self.step % cfg.train.eval_interval == 0 or self.step == cfg.train.steps
                ):
                    ev = self.evaluate()
                    if ev:
                        self.metrics.log(self.step, ev)
                        bar.write(f"step {self.step}: val loss {ev['loss/val']:.4f} ppl {ev['loss/val_ppl']:.2f}")

                if self.checkpoints.after_step(self.step):  # run.save_interval, run.save_final
                    self._last_sync = None  # the next step is timed from its own start, not from the save
        finally:
            try:
                self.checkpoints.wait()  # the last async save completes before we return / exit
            finally:
                bar.close()
                self.metrics.close()
                self.data.close()
        return losses
