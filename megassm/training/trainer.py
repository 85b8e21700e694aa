"""The training loop: one loop for every scale.

    Trainer(cfg).fit()

Single device for now (CPU, or one GPU with bf16 autocast). Parallel plans (TP/SP -> CP -> PP ->
activation checkpointing -> compile -> data parallel) are applied to the model from outside by their
own modules when they exist; until then a multi-process launch is refused before any compute.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from megassm.config import Config, ConfigError, data_parallel_size, dump_config, world_size
from megassm.models.coffee import deer_stats
from megassm.parallel import runtime as prt
from megassm.parallel.engines import build_engine, check_engine
from megassm.training import checkpoint as ckpt
from megassm.training import preemption
from megassm.training.flops import flops_per_sequence, mfu, peak_flops_for
from megassm.training.metrics import MetricsLogger, ProgressBar, memory_scalars
from megassm.training.optim import LRScheduler, build_optimizer, clip_grad_norm
from megassm.training.sharded import SHARDED, canonical_param_names, checkpoint_format, load_sharded

log = logging.getLogger("megassm.train")


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss or gradient norm; the message names the last good checkpoint."""


def check_supported(cfg: Config) -> None:
    """Refuse layouts this build cannot run yet, before any model is built or a GPU is touched."""
    p = cfg.parallel
    if p.pp > 1 and p.cp > 1:
        raise ConfigError(f"parallel.pp={p.pp} with parallel.cp={p.cp}: pipeline parallelism combined with context "
                          "parallelism is not built; set one of them to 1 (PP x TP x DP is)")
    if p.sp and p.tp == 1:
        raise ConfigError("parallel.sp=true needs parallel.tp > 1 (sequence parallelism shards over the TP group)")
    if world_size(cfg) != 1 and int(os.environ.get("WORLD_SIZE", "1")) != world_size(cfg):
        raise ConfigError(
            f"parallel.tp={p.tp} with world size {world_size(cfg)} but WORLD_SIZE={os.environ.get('WORLD_SIZE', '1')}: "
            "launch one process per rank with torchrun (torchrun --nproc_per_node N -m megassm.train ...)"
        )
    check_engine(cfg)  # DDP / FSDP2 / DeepSpeed layouts (parallel/engines.py)
    if cfg.train.bptt_windows != 1 and not cfg.train.bptt:
        raise ConfigError(f"train.bptt_windows={cfg.train.bptt_windows} needs train.bptt=true")
    if cfg.train.bptt and p.pp > 1 and cfg.train.bptt_windows > 1:  # BPTT: training/bptt.py, docs/bptt.md
        raise ConfigError(
            f"train.bptt_windows={cfg.train.bptt_windows} with parallel.pp={p.pp}: backpropagating through several "
            "windows would need one graph across several pipeline schedule runs; pipeline stages carry state with "
            "truncated BPTT (train.bptt_windows=1)"
        )
    if cfg.train.cuda_graph:
        _check_cuda_graph(cfg)
    _check_group_builder(cfg)
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible (use train.device=auto or cpu)")
    if cfg.train.precision == "bf16" and _pick_device(cfg).type == "cpu":
        log.warning("train.precision=bf16 on CPU: autocast to bf16 on CPU is slow; fp32 is the CPU default")


def _check_group_builder(cfg: Config) -> None:
    """MEGASSM_PROCESS_GROUPS (parallel/state.py): a known value, and megatron-core installed when it is asked
    for by a multi-process run."""
    import importlib.util

    from megassm.parallel.state import group_builder

    try:
        builder = group_builder()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if builder == "megatron" and world_size(cfg) > 1 and importlib.util.find_spec("megatron") is None:
        raise ConfigError("MEGASSM_PROCESS_GROUPS=megatron, but megatron-core is not installed "
                          "(pip install megatron-core, or MEGASSM_PROCESS_GROUPS=auto)")


def _check_cuda_graph(cfg: Config) -> None:
    """train.cuda_graph=true: refuse what a captured micro-batch cannot hold (training/cuda_graph.py)."""
    from megassm.config import blocks_of
    from megassm.training.cuda_graph import GRAPH_SAFE_LETTERS

    p, t = cfg.parallel, cfg.train
    why = None
    if p.tp > 1 or p.cp > 1 or p.pp > 1:
        why = (f"parallel.tp={p.tp}, parallel.cp={p.cp}, parallel.pp={p.pp}: their collectives run inside the "
               "forward and backward; only data parallelism (parallel.engine=ddp) combines with it")
    elif p.engine != "ddp" and data_parallel_size(cfg) > 1:
        why = f"parallel.engine={p.engine}: FSDP2 and DeepSpeed hook the backward; use parallel.engine=ddp"
    elif t.bptt:
        why = "train.bptt=true: the carried state changes between windows"
    elif t.activation_checkpointing:
        why = "train.activation_checkpointing=true: recomputation under a capture is not tested"
    else:
        bad = sorted(set(blocks_of(cfg.model.pattern)) - set(GRAPH_SAFE_LETTERS))
        if bad:
            why = (f"model.pattern='{cfg.model.pattern}' has block(s) {', '.join(repr(c) for c in bad)}: their forward "
                   "reads values on the host (attention picks its causal kernel per batch, COFFEE tests values, "
                   "B'MOJO counts memory groups per batch of packed documents); graph-safe blocks: " + ", ".join(f"{k} {v}" for k, v in GRAPH_SAFE_LETTERS.items()))
    if why is not None:
        raise ConfigError(f"train.cuda_graph=true: {why}")


def _pick_device(cfg: Config) -> torch.device:
    if cfg.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.train.device)


def _autocast_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """None means plain fp32; otherwise autocast to this dtype (parameters stay fp32 masters)."""
    prec = cfg.train.precision
    if prec == "auto":
        prec = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if prec == "bf16" else None


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(dump_config(cfg).encode()).hexdigest()[:16]


def write_resolved_config(cfg: Config, run_dir: str) -> str:
    """Write run_dir/config.yaml atomically: temp name, then rename."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(dump_config(cfg))
    os.replace(tmp, path)
    return path


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
        self.cfg = cfg
        self.device = _pick_device(cfg)
        # multi-process: torch.distributed from torchrun's env, groups from megatron-core (megassm.parallel)
        self.groups, self.device = prt.setup(cfg, self.device)
        self.amp_dtype = _autocast_dtype(cfg, self.device)
        if cfg.train.cuda_graph and self.device.type != "cuda":  # the layout was checked above; this run's device
            raise ConfigError(f"train.cuda_graph=true needs a CUDA device; this run uses {self.device}")
        self.run_dir = cfg.run.dir
        self.dp = data_parallel_size(cfg)
        self.accum = cfg.train.global_batch // (cfg.train.micro_batch * self.dp)
        self.tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        if cfg.train.bptt:  # one optimizer step consumes train.bptt_windows consecutive windows per row
            self.tokens_per_step *= cfg.train.bptt_windows
        self.step = 0

        if prt.is_rank0(self.groups):
            write_resolved_config(cfg, self.run_dir)
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
        # PP: shapes only (meta), then each rank materializes its own stages (parallel/pp.py)
        model = build_model(cfg.model, vocab_size=self.data.vocab_size, device="meta" if self.groups.pp > 1 else "cpu")
        n_params = model.num_parameters()  # canonical count, before any sharding or pipeline split
        model = prt.init_model(model, self.groups, cfg)  # canonical weights
        self.model = prt.prepare_model(model.to(self.device), self.groups, cfg)  # TP/SP plan (no-op at tp=1)
        if cfg.train.loss_chunk_tokens:  # head + loss in checkpointed chunks (models/lm.py head_loss)
            self.model.loss_chunk_tokens = cfg.train.loss_chunk_tokens
        # the data-parallel engine last (DDP / FSDP2 / DeepSpeed ZeRO); it owns the optimizer step
        self.engine = build_engine(cfg, self.model, self.groups, self.device, bf16=self.amp_dtype is torch.bfloat16)
        self.optimizer = self.engine.make_optimizer(lambda: build_optimizer(
            self.model.param_groups(cfg.optim.weight_decay), cfg.optim, self.device.type))
        self.scheduler = LRScheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.checkpointer = None  # run.checkpoint_format=sharded: DCP, every rank writes (training/sharded.py)
        if cfg.run.checkpoint_format == "sharded":
            from megassm.training.sharded import ShardedCheckpointer

            self.checkpointer = ShardedCheckpointer(self.groups, async_save=cfg.run.async_save,
                                                    keep_last=cfg.run.keep_last)
        self.graphed = None  # train.cuda_graph: each micro-batch is one graph replay (training/cuda_graph.py)
        if cfg.train.cuda_graph:
            from megassm.training.cuda_graph import GraphedMicroBatch

            self.graphed = GraphedMicroBatch(list(self.model.parameters()), self._forward_backward)
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

        self.last_checkpoint: str | None = None
        resume_path = ckpt.resolve_resume(self.run_dir, cfg.run.resume)
        if resume_path is not None:
            self._load(resume_path)

        # resume_step: lines a crashed run wrote after this checkpoint are superseded, not repeated
        self.metrics = MetricsLogger(self.run_dir, tensorboard=cfg.run.tensorboard, rank=self.groups.rank,
                                     resume_step=self.step if resume_path is not None else None)
        log.info(
            "model: %s blocks '%s', %.2fM parameters, vocab %d (padded %d); device %s, %s; "
            "global batch %d = micro %d x accumulation %d x dp %d; %.3g train FLOPs/token",
            self.model.n_layers, cfg.model.pattern, self.n_params / 1e6, self.data.vocab_size, vocab_padded,
            self.device, "bf16 autocast" if self.amp_dtype else "fp32", cfg.train.global_batch,
            cfg.train.micro_batch, self.accum, self.dp, self.train_flops_per_token,
        )

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
        lr = self.scheduler.step_to(self.step)
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        if self.carrier is not None:  # BPTT: states carried across windows, K windows per step (bptt.py)
            data_time = self.carrier.train_step(self, loss_sum)
        else:
            data_time = self._accumulate_pipeline(loss_sum) if self.groups.pp > 1 else self._accumulate(loss_sum)
        # TP partial grads summed, tied embeddings (PP), CP sum, then what the engine leaves to reduce over DP
        prt.finish_grads(self.model, self.groups, self.engine)
        loss_sum = prt.mean_over_dp(loss_sum, self.groups)
        loss = (loss_sum / self.accum).item()  # one host sync per step

        def check(grad_norm: float) -> None:
            if not math.isfinite(loss) or not math.isfinite(grad_norm):
                raise NonFiniteLossError(self._non_finite_message(loss, grad_norm))

        grad_norm = self.engine.clip_and_step(self.cfg.train.grad_clip, check)  # clip, check, step, zero
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return StepResult(loss, grad_norm, lr, self.tokens_per_step, time.perf_counter() - t0, data_time)

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
            with self.engine.micro_batch(last=i == self.accum - 1):  # DDP: no_sync until the last
                loss_sum += run(batch)
        return data_time

    def _forward_backward(self, batch: dict) -> torch.Tensor:
        """One micro-batch's forward and backward (gradients accumulate); returns its loss, detached."""
        with self._autocast():
            out = self.engine.forward(batch["tokens"], seq_idx=batch["seq_idx"], labels=batch["labels"])
        self.engine.backward(out.loss, self.accum)
        return out.loss.detach()

    def _accumulate_pipeline(self, loss_sum: torch.Tensor) -> float:
        """PP: the step's `accum` micro-batches through the pipeline schedule (1F1B); every rank gets the
        last stage's loss sum. Returns the seconds spent waiting for data."""
        td = time.perf_counter()
        batches = [self._to_device(self.data.next_batch()) for _ in range(self.accum)]
        data_time = time.perf_counter() - td
        loss_sum += prt.pipeline_step(self.model, batches, self._autocast)
        return data_time

    def _non_finite_message(self, loss: float, grad_norm: float) -> str:
        where = (
            f"the last good checkpoint is {self.last_checkpoint} (resume with --resume auto, "
            "perhaps with a lower optim.lr)"
            if self.last_checkpoint
            else "no checkpoint was written yet in this run (set run.save_interval to keep one)"
        )
        return f"non-finite loss {loss} (grad norm {grad_norm}) at step {self.step + 1}; training stopped; {where}"

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        total, n = 0.0, 0
        if self.groups.pp > 1:  # all validation batches through the pipeline at once
            batches = [self._to_device(b) for b in self.data.valid_batches(self.cfg.train.eval_batches)]
            if batches:
                total, n = float(prt.pipeline_eval(self.model, batches, self._autocast)), len(batches)
        else:
            for batch in self.data.valid_batches(self.cfg.train.eval_batches):
                batch = self._to_device(batch)
                with self._autocast():
                    out = self.model(batch["tokens"], seq_idx=batch["seq_idx"], labels=batch["labels"])
                total += out.loss.item()
                n += 1
        self.model.train()
        if n == 0:
            return {}
        val = float(prt.mean_over_dp(torch.tensor(total / n, device=self.device), self.groups))
        return {"loss/val": val, "loss/val_ppl": math.exp(min(val, 50.0))}

    # ------------------------------------------------------------------------------------------------
    def _extra_state(self, carried: dict | None = None) -> dict:
        extra = {
            "scheduler": self.scheduler.state_dict(),
            "data": self.data.state_dict(),
            "rng": ckpt.capture_rng_state(),
            "config_hash": config_hash(self.cfg),
            "consumed_tokens": self.step * self.tokens_per_step,
        }
        if self.carrier is not None:
            extra["carried_states"] = carried
        return extra

    def save(self) -> str:
        if self.checkpointer is not None:  # sharded: every rank writes its pieces (async: in the background)
            carried = self.carrier.state_dict() if self.carrier is not None else None  # collective
            extra = self._extra_state(carried) if prt.is_rank0(self.groups) else None
            path = self.checkpointer.save(self.run_dir, self.step, model=self.model, optimizer=self.optimizer,
                                          engine=self.engine, extra=extra)
            self.last_checkpoint = path
            log.info("checkpoint %s: %s", path, "snapshot taken, writing in the background"
                     if self.cfg.run.async_save else "saved (sharded)")
            return path
        # canonical single-device layout: TP shards gathered on every rank (collective), rank 0 writes
        if self.engine.handles_states:  # FSDP2 / DeepSpeed shards -> canonical on rank 0 (collective)
            model_state, optim_state = self.engine.gather_states()
        else:
            model_state, optim_state = prt.gather_states(self.model, self.optimizer, self.groups)
        # BPTT: the canonical carried states on rank 0 (collective: every rank's rows / blocks / shards)
        carried = self.carrier.state_dict() if self.carrier is not None else None
        path = os.path.join(self.run_dir, ckpt.CHECKPOINTS, ckpt.checkpoint_name(self.step))
        if prt.is_rank0(self.groups):
            extra = self._extra_state(carried)
            # the optimizer's parameter names by index: lets megassm-checkpoint convert it without a config
            extra["param_names"] = canonical_param_names(self.model, self.optimizer, self.engine)
            path = ckpt.save_checkpoint(
                self.run_dir, self.step, model=self.model, optimizer=self.optimizer,
                extra=extra, keep_last=self.cfg.run.keep_last,
                model_state=model_state, optim_state=optim_state,
            )
        prt.barrier(self.groups)
        self.last_checkpoint = path
        log.info("saved checkpoint %s", path)
        return path

    def _load(self, path: str) -> None:
        if checkpoint_format(path) == SHARDED:  # each rank reads the chunks overlapping its own pieces
            extra = ckpt.load_checkpoint(path, model=None, optimizer=None)
            load_sharded(path, self.model, self.optimizer, self.groups, self.engine)
        elif self.engine.handles_states:  # canonical checkpoint -> FSDP2 / DeepSpeed shards
            extra = ckpt.load_checkpoint(path, model=None, optimizer=None)
            self.engine.load_states(*ckpt.read_model_and_optim(path))
        elif self.groups.tp > 1 or self.groups.pp > 1:  # canonical checkpoint -> this rank's shards / stages
            extra = ckpt.load_checkpoint(path, model=None, optimizer=None)
            prt.load_states(path, self.model, self.optimizer)
        else:
            extra = ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        self.step = int(extra["step"])
        self.scheduler.load_state_dict(extra["scheduler"])
        self.data.load_state_dict(extra["data"])
        if self.carrier is not None:
            self.carrier.load_state_dict(extra.get("carried_states"), data_window=extra["data"].get("window"))
        ckpt.restore_rng_state(extra["rng"])
        if extra.get("config_hash") != config_hash(self.cfg):
            log.warning("resuming %s with a config that differs from the one it was saved with", path)
        self.last_checkpoint = path
        log.info("resumed from %s at step %d", path, self.step)

    # ------------------------------------------------------------------------------------------------
    def _preempt(self) -> None:
        """Checkpoint (unless this step's checkpoint exists already) and mark the run preempted: megassm.train
        then exits with preemption.PREEMPT_EXIT_CODE (docs/launch.md)."""
        saved = self.last_checkpoint is not None and os.path.basename(
            self.last_checkpoint.rstrip(os.sep)) == ckpt.checkpoint_name(self.step)
        if self.step > 0 and not saved:
            self.save()
        self.preempted = True
        log.warning("preempted (%s) at step %d: checkpoint %s", preemption.reason() or "signal on another rank",
                    self.step, self.last_checkpoint)

    def fit(self) -> list[float]:
        """Train to cfg.train.steps. Returns the per-step training losses of this invocation."""
        cfg = self.cfg
        losses: list[float] = []
        self.preempted = False  # set when a preemption signal stopped the loop (megassm.train exits 99)
        bar = ProgressBar(cfg.train.steps, self.step, enabled=cfg.run.progress and prt.is_rank0(self.groups))
        window_tokens, window_time, window_data = 0, 0.0, 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            while self.step < cfg.train.steps:
                if preemption.agreed_stop(self.device):  # SIGUSR1/SIGTERM on any rank: every rank stops here
                    self._preempt()
                    break
                r = self.train_step()
                self.step += 1
                losses.append(r.loss)
                window_tokens += r.tokens
                window_time += r.step_time
                window_data += r.data_time
                tps = r.tokens / r.step_time
                bar.update(self.step, loss=r.loss, tokens_per_s=tps)

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
                    }
                    if self.peak_flops:
                        scalars["throughput/mfu"] = mfu(w_tps, self.train_flops_per_token, self.peak_flops)
                    self.metrics.log(self.step, scalars)
                    window_tokens, window_time, window_data = 0, 0.0, 0.0

                if cfg.train.eval_interval and (
                    self.step % cfg.train.eval_interval == 0 or self.step == cfg.train.steps
                ):
                    ev = self.evaluate()
                    if ev:
                        self.metrics.log(self.step, ev)
                        bar.write(f"step {self.step}: val loss {ev['loss/val']:.4f} ppl {ev['loss/val_ppl']:.2f}")

                if (cfg.run.save_interval and self.step % cfg.run.save_interval == 0) or (
                    cfg.run.save_final and self.step == cfg.train.steps
                ):
                    self.save()
        finally:
            try:
                if self.checkpointer is not None:  # the last async save completes before we return / exit
                    self.checkpointer.wait()
            finally:
                bar.close()
                self.metrics.close()
                self.data.close()
        return losses
