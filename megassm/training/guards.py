"""Long-run guards (docs/reliability.md "Loss spikes" and "Stragglers"): the loss / gradient-norm spike guard
(`train.spike_action`) and the straggler report (`train.straggler_interval`).

    guard = SpikeGuard(cfg.train, groups, device)
    take = guard.judge(step, loss, grad_norm, checkpoint=..., declines=...)   # inside clip_and_step's check:
                                                                               # False declines the update
    guard.rollback_due -> the trainer restores the last checkpoint, keeps the data position, guard.rolled_back(...)

    report = StragglerReport(cfg, groups, device, accum)
    report.begin(step)                     # before the step's micro-batches
    with report.forward(): out = forward(...)          # eager: the forward, device-synchronized on report steps
    with report.replay(): loss = graphed(batch)        # train.cuda_graph: the micro-batch's replay
    scalars = report.report(step, data_time)           # collective on report steps: every rank calls it

Spike guard. A step is a spike when its loss or its gradient norm (before clipping) is above mean + sigma x std
(sample std) of the same quantity over the last `spike_window` accepted steps, judged once `spike_min_steps` steps
are in the window. The defaults (window 128, sigma 6, judging from half a window) are OLMo-core's skip-step
optimizer's (SkipStepOptimizer: rolling_interval_length=128, sigma_factor=6, max(2, 128 // 2) values first),
the guard OLMo 2 trained with. Only accepted steps enter the window, so a spike does not widen the band that
judges the next step. skip: the step's gradients are discarded (no optimizer step); the lr schedule and the data
go on. rollback: the last checkpoint is restored (model, optimizer, scheduler, RNG, BPTT states, this window)
but the data position is kept, so the batches that spiked are not replayed (PaLM, section 5.1: restart ~100
steps before the spike and skip the batches). Non-finite losses are not the guard's: they stop the run (exit 3).

The decision is made on every rank from the same numbers: the loss is already the data-parallel mean and the
norm the global one, equal on every rank as long as the collectives give bitwise-equal results everywhere;
the guard does not rely on that and takes the maximum of (loss, norm) over the world first (one all-reduce of
two numbers per step, only while the guard is on), so no rank can step while another declines.
"""
from __future__ import annotations

import contextlib
import logging
import socket
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megassm.training import consensus

log = logging.getLogger("megassm.train")

__all__ = ["SpikeGuard", "SpikeStopError", "StragglerReport", "GUARD_STATE_VERSION", "MIN_LAG_S"]

GUARD_STATE_VERSION = 1
MIN_LAG_S = 0.005  # a slowest rank less than this behind the median is timer and scheduling noise: never named


class SpikeStopError(RuntimeError):
    """train.spike_action=rollback could not recover: spikes went on after train.spike_max_rollbacks rollbacks to
    the same checkpoint, or that checkpoint no longer loads. megassm-train exits EXIT_SPIKE (7)."""


@dataclass
class Spike:
    step: int  # the step that spiked (1-based, the step numbers of metrics.jsonl)
    what: str  # "loss 8.41 > 4.02 (mean 3.91 + 6 x std 0.0183)" and / or the norm's


def _band(values, sigma: float) -> tuple[float, float, float]:
    mean = statistics.fmean(values)
    std = statistics.stdev(values)  # sample std, as torch.std_mean in OLMo-core's guard
    return mean + sigma * std, mean, std


class SpikeGuard:
    """The spike decision and its window (one per rank, identical on every rank). The window is recorded
    whatever train.spike_action says, so a run may switch the guard on at a resume and judge at once."""

    def __init__(self, train_cfg, groups, device: torch.device):
        t = train_cfg
        self.action = t.spike_action
        self.sigma = t.spike_sigma
        self.min_steps = t.spike_min_steps if t.spike_min_steps is not None else max(2, t.spike_window // 2)
        self.max_rollbacks = t.spike_max_rollbacks
        self.losses: deque[float] = deque(maxlen=t.spike_window)
        self.norms: deque[float] = deque(maxlen=t.spike_window)
        self.skipped = 0  # cumulative over the run (saved in checkpoints; kept across a rollback)
        self.rollbacks = 0
        self.rollbacks_here = 0  # rollbacks to the current last checkpoint (a new checkpoint resets it)
        self.pending: Spike | None = None  # a spike the trainer rolls back from after this step
        self.world = groups.world_size
        self.speak = groups.rank == 0
        self.device = device

    @property
    def on(self) -> bool:
        return self.action != "off"

    @property
    def rollback_due(self) -> bool:
        return self.pending is not None

    def _agree(self, loss: float, norm: float) -> tuple[float, float]:
        if self.world == 1:
            return loss, norm
        x = torch.tensor([loss, norm], dtype=torch.float64, device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)  # the world group: every rank of every parallel dimension
        return tuple(float(v) for v in x.cpu())

    def _spike(self, step: int, loss: float, norm: float) -> Spike | None:
        if len(self.losses) < self.min_steps:
            return None
        parts = []
        for name, value, window in (("loss", loss, self.losses), ("grad norm", norm, self.norms)):
            limit, mean, std = _band(window, self.sigma)
            if value > limit:
                parts.append(f"{name} {value:.6g} > {limit:.6g} (mean {mean:.6g} + {self.sigma:g} x std {std:.3g} "
                             f"of the last {len(window)} accepted steps)")
        return Spike(step, "; ".join(parts)) if parts else None

    def judge(self, step: int, loss: float, norm: float, *, checkpoint: str | None, declines: bool) -> bool:
        """Whether step `step` may update the weights (False: the engine declines the step). Called between the
        gradient norm and the optimizer step on every rank (finite loss and norm: the trainer stops on others).
        `checkpoint`: the one a rollback would restore; `declines`: whether the engine can still decline
        (DeepSpeed has stepped already). Raises SpikeStopError when a rollback is due past the limit."""
        self.pending = None
        if not self.on:
            self._accept(loss, norm)
            return True
        loss, norm = self._agree(loss, norm)
        spike = self._spike(step, loss, norm)
        if spike is None:
            self._accept(loss, norm)
            return True
        if self.action == "rollback" and checkpoint is not None:
            if self.rollbacks_here >= self.max_rollbacks:
                tried = (f"{self.rollbacks_here} rollback(s) to {checkpoint} did not get past it" if self.rollbacks_here
                         else f"no rollback allowed (the last checkpoint is {checkpoint})")
                raise SpikeStopError(
                    f"spike at step {step}: {spike.what}; {tried} (train.spike_max_rollbacks={self.max_rollbacks}); "
                    "training stopped. Lower optim.lr or inspect the data near this step; --resume auto restarts "
                    "from that checkpoint's data position")
            self.pending = spike
            return not declines  # the trainer restores the checkpoint after the step
        fallback = "" if self.action == "skip" else " (no checkpoint to roll back to yet: skipped instead)"
        if not declines:  # rollback without a checkpoint under DeepSpeed, which stepped before the norm was known
            self._warn("spike at step %d: %s; no checkpoint to roll back to yet and the deepspeed engine has already "
                       "stepped: the update stands", step, spike.what)
            return True
        self.skipped += 1
        self._warn("spike at step %d: %s; step skipped%s: gradients discarded, no optimizer step (%d skipped in this "
                   "run)", step, spike.what, fallback, self.skipped)
        return False

    def _accept(self, loss: float, norm: float) -> None:
        self.losses.append(loss)
        self.norms.append(norm)

    def _warn(self, *args) -> None:
        if self.speak:  # the decision is the same on every rank: one line per job
            log.warning(*args)

    def rolled_back(self, spike: Spike, to_step: int, path: str, counters: tuple[int, int]) -> None:
        """After the trainer restored `path` (its window came with it): count, with the counters of before the
        load (the checkpoint's are older), and log both steps."""
        self.skipped, self.rollbacks = counters
        self.rollbacks += 1
        self.rollbacks_here += 1
        self.pending = None
        self._warn("spike at step %d: %s; rolled back to %s (step %d), rollback %d of at most %d to it; the data "
                   "goes on past step %d's batches (the batches of %d step(s) are not replayed)", spike.step,
                   spike.what, path, to_step, self.rollbacks_here, self.max_rollbacks, spike.step,
                   spike.step - to_step)

    def saved(self) -> None:
        """A new checkpoint: rollbacks now go to it."""
        self.rollbacks_here = 0

    def counters(self) -> tuple[int, int]:
        return self.skipped, self.rollbacks

    def scalars(self) -> dict:
        """Cumulative counts for metrics.jsonl / TensorBoard (none while the guard is off)."""
        if not self.on:
            return {}
        return {"guard/skipped_steps": self.skipped, "guard/rollbacks": self.rollbacks}

    def state_dict(self) -> dict:
        return {"version": GUARD_STATE_VERSION, "losses": list(self.losses), "norms": list(self.norms),
                "skipped": self.skipped, "rollbacks": self.rollbacks}

    def load_state_dict(self, d: dict | None) -> None:
        """The window and counts of a checkpoint (None: saved before the guard existed; the window refills)."""
        self.losses.clear()
        self.norms.clear()
        if d is None or d.get("version") != GUARD_STATE_VERSION:
            if self.on:
                log.info("spike guard: the checkpoint holds no window (%s); judging resumes after %d accepted steps",
                         "none saved" if d is None else f"version {d.get('version')}", self.min_steps)
            return
        self.losses.extend(float(v) for v in d["losses"])
        self.norms.extend(float(v) for v in d["norms"])
        self.skipped, self.rollbacks = int(d["skipped"]), int(d["rollbacks"])


# ----------------------------------------------------------------------------------------------------
# Stragglers
# ----------------------------------------------------------------------------------------------------


class StragglerReport:
    """Each rank's own work on report steps, gathered over the world; the slowest rank named when it lags.

    With synchronous collectives every rank's step takes the same wall time (the fast ones wait inside the
    collectives), so the figure is a rank's own work: its data wait (reading and copying the micro-batches) plus
    its forward compute, timed per micro-batch with the device synchronized before and after the forward, and
    counted as the median micro-batch x micro-batches (one slow outlier, a GC pause, does not name a rank). The
    forward holds no data-parallel collective under DDP (and ZeRO-1, and DeepSpeed ZeRO 0-2). Under FSDP2 the
    forward all-gathers weights from the peers; with parallel.fsdp_reshard=step only the step's first
    micro-batch does (the later ones find them gathered), so it is left out, and other FSDP2 layouts are not
    measured. Under train.cuda_graph the forward and backward are one replay with no data-parallel collective:
    the replays are timed. Under TP / CP the forward's own collectives make a TP / CP group's ranks wait for
    each other: the figure then names a rank of the slowest group. Pipeline parallelism (stages wait for each
    other's activations and do different work), BPTT (the carrier runs its windows) and DeepSpeed ZeRO-3 (every
    forward gathers) are not measured (logged once). The first step of an invocation is never reported
    (compilation, autotuning, graph capture)."""

    def __init__(self, cfg, groups, device: torch.device, accum: int):
        t, p = cfg.train, cfg.parallel
        self.interval = t.log_interval if t.straggler_interval is None else t.straggler_interval
        self.fraction = t.straggler_fraction
        self.groups, self.device = groups, device
        self.mode: str | None = None  # "forward" | "replay" | None (not measured)
        self.skip_first = False
        self.active = False
        self.first_step: int | None = None
        self.times: list[float] = []
        if self.interval == 0 or groups.world_size == 1:
            return  # off, or no peer to compare with
        dp_engine = p.engine if groups.dp > 1 else "none"
        why = None
        if groups.pp > 1:
            why = ("pipeline parallelism: a stage's time is its wait for the previous stage's activations plus "
                   "work that differs by stage, so there is no per-rank figure to compare")
        elif t.bptt:
            why = "train.bptt=true: the BPTT carrier runs the windows' forwards (not timed)"
        elif dp_engine == "fsdp2" and (p.fsdp_reshard != "step" or accum < 2):
            why = (f"parallel.engine=fsdp2 with parallel.fsdp_reshard={p.fsdp_reshard} and {accum} micro-batch(es) "
                   "per step: every timed forward all-gathers weights from the peers and waits for them (measured "
                   "with fsdp_reshard=step and 2 or more micro-batches, the first left out)")
        elif dp_engine == "deepspeed" and p.zero_stage == 3:
            why = "parallel.engine=deepspeed with ZeRO-3: every forward gathers the weights from the peers"
        if why is not None:
            log.info("straggler report not measured: %s", why)
            return
        self.mode = "replay" if t.cuda_graph else "forward"
        self.skip_first = dp_engine == "fsdp2"
        self.hosts = consensus.gather(socket.gethostname())  # collective: every rank takes this branch alike

    def begin(self, step: int) -> None:
        if self.first_step is None:
            self.first_step = step
        self.active = self.mode is not None and step % self.interval == 0 and step != self.first_step
        self.times = []

    def forward(self):
        return self._timed() if self.active and self.mode == "forward" else contextlib.nullcontext()

    def replay(self):
        return self._timed() if self.active and self.mode == "replay" else contextlib.nullcontext()

    def restart(self) -> None:
        """The next step is an invocation's first again (a rollback reloaded everything)."""
        self.first_step = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _timed(self):
        self._sync()  # the work queued before (the previous micro-batch's backward) is not this forward's
        t0 = time.perf_counter()
        yield
        self._sync()
        self.times.append(time.perf_counter() - t0)

    def report(self, step: int, data_time: float) -> dict:
        """On a report step (collective over the world): every rank's work, the WARNING naming the slowest rank
        when it exceeds the median by more than train.straggler_fraction (rank 0), and the scalars to log."""
        if not self.active:
            return {}
        self.active = False
        timed = self.times[1:] if self.skip_first and len(self.times) > 1 else self.times
        work = data_time + (statistics.median(timed) * len(self.times) if timed else 0.0)
        mine = torch.tensor([work], dtype=torch.float64, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.groups.world_size)]
        dist.all_gather(parts, mine)
        works = [float(x) for x in torch.cat(parts).cpu()]
        median = statistics.median(works)
        slowest = max(range(len(works)), key=works.__getitem__)
        ratio = works[slowest] / median if median > 0 else 1.0
        if ratio > 1.0 + self.fraction and works[slowest] - median > MIN_LAG_S and self.groups.rank == 0:
            log.warning("straggler at step %d: rank %d (host %s) spent %.3f s on data wait + forward, %.2fx the median "
                        "%.3f s of %d ranks (train.straggler_fraction=%g; fastest %.3f s)", step, slowest,
                        self.hosts[slowest], works[slowest], ratio, median, len(works), self.fraction, min(works))
        return {"straggler/slowest_over_median": ratio, "straggler/slowest_rank": slowest}
