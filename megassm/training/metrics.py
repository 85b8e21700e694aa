"""Metrics: TensorBoard scalars + a JSON-lines file (+ Weights & Biases with run.wandb), a progress bar, step
timing, peak memory.

    metrics = MetricsLogger(run_dir, tensorboard=True, rank=rank, resume_step=start_step)
    metrics.log(step, {"loss/train": 2.31, "optim/lr": 3e-4, "throughput/tokens_per_s": 1.2e5})
    metrics.close()

run_dir/metrics.jsonl gets one line per `log` call: {"step": 10, "loss": 2.31, "lr": 0.0003,
"tokens_per_s": 120000.0, "time": <unix time>}. Tag -> key: see SHORT_NAMES; any other tag has its '/'
replaced by '_' ("loss/val" -> "loss_val"). Non-finite values are written as null (strict JSON).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("megassm.metrics")

__all__ = [
    "SHORT_NAMES",
    "short_name",
    "MetricsLogger",
    "ProgressBar",
    "StepTimer",
    "StepStats",
    "peak_memory_gib",
    "memory_scalars",
]

SHORT_NAMES = {
    "loss/train": "loss",
    "optim/lr": "lr",
    "optim/grad_norm": "grad_norm",
    "throughput/tokens_per_s": "tokens_per_s",
    "throughput/mfu": "mfu",
}


def short_name(tag: str) -> str:
    return SHORT_NAMES.get(tag, tag.replace("/", "_"))


def _to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        value = value.detach().item()
    return float(value)


def _line_ranges(numbers: list[int], most: int = 20) -> str:
    """'2, 5-7, 12' for [2, 5, 6, 7, 12]; past `most` ranges, the count of the lines left out."""
    ranges: list[list[int]] = []
    for n in numbers:
        if ranges and n == ranges[-1][1] + 1:
            ranges[-1][1] = n
        else:
            ranges.append([n, n])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges[:most])
    rest = sum(b - a + 1 for a, b in ranges[most:])
    return text + (f" and {rest} more" if rest else "")


class MetricsLogger:
    """Scalars to TensorBoard (run_dir/tensorboard), run_dir/metrics.jsonl and, with `wandb` (wandb_sink.py
    wandb_settings: run.wandb=online|offline), a Weights & Biases run. Only rank 0 writes.

    The JSON file is opened in append mode, so a resumed run continues it. Pass `resume_step` (the step
    the run resumes from) to drop what a previous attempt logged after that step: jsonl lines with a
    larger step are removed, and TensorBoard purges its events from resume_step + 1 on. Lines that are not
    UTF-8 JSON are moved to metrics.jsonl.unreadable with a warning naming them. Each line is flushed as it is
    written.
    """

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True, rank: int = 0,
                 resume_step: int | None = None, wandb: dict | None = None):
        self.run_dir = os.fspath(run_dir)
        self.enabled = rank == 0
        self.writer = None
        self._file = None
        self.wandb = None
        if not self.enabled:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        self.jsonl_path = os.path.join(self.run_dir, "metrics.jsonl")
        if resume_step is not None:
            self._truncate_after(resume_step)
        self._file = open(self.jsonl_path, "a")
        if tensorboard:
            with warnings.catch_warnings():  # torch's tensorboard import touches deprecated torch.jit APIs
                warnings.simplefilter("ignore", DeprecationWarning)
                from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self.writer = SummaryWriter(log_dir=os.path.join(self.run_dir, "tensorboard"), purge_step=purge)
        if wandb is not None:  # the module imports wandb: only reached with run.wandb on
            from megassm.training.wandb_sink import WandbSink

            self.wandb = WandbSink(self.run_dir, **wandb, resuming=resume_step is not None)

    def _truncate_after(self, step: int) -> None:
        """Drop the lines logged after `step` (this attempt logs those steps again) and set aside every line that
        is not UTF-8 JSON (damaged bytes, a line cut short by a crash) into metrics.jsonl.unreadable, with a
        WARNING naming the file and the lines; every other line is kept byte for byte."""
        try:
            with open(self.jsonl_path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        kept, bad, superseded = [], [], 0
        for n, raw in enumerate(lines, 1):
            try:
                rec = json.loads(raw.decode("utf-8"))
            except ValueError:  # UnicodeDecodeError is one
                bad.append((n, raw))
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
                superseded += 1
                continue
            kept.append(raw + b"\n")
        if not bad and not superseded and (not data or data.endswith(b"\n")):
            return
        if bad:  # set aside before the file is replaced: a crash in between leaves the lines twice, never none
            aside = self.jsonl_path + ".unreadable"
            with open(aside, "ab") as f:
                f.writelines(raw + b"\n" for _, raw in bad)
            log.warning("%s: %s %s %s not UTF-8 JSON (damaged bytes, or a line cut short by a crash): moved to %s",
                        self.jsonl_path, "line" if len(bad) == 1 else "lines", _line_ranges([n for n, _ in bad]),
                        "is" if len(bad) == 1 else "are", aside)
        tmp = f"{self.jsonl_path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.jsonl_path)
        if superseded:
            log.info("metrics.jsonl: dropped %d lines logged after step %d by an earlier attempt", superseded, step)

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        if not self.enabled or not scalars:
            return
        rec: dict[str, Any] = {"step": int(step)}
        values: dict[str, float] = {}
        for tag, value in scalars.items():
            if value is None:
                continue
            v = values[tag] = _to_float(value)
            if self.writer is not None:
                self.writer.add_scalar(tag, v, int(step))
            rec[short_name(tag)] = v if math.isfinite(v) else None
        if self.wandb is not None and values:
            self.wandb.log(int(step), values)
        rec["time"] = round(time.time(), 3)
        self._file.write(json.dumps(rec, allow_nan=False) + "\n")
        self._file.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _fmt_rate(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.0f}"


class ProgressBar:
    """tqdm bar over optimizer steps: step/total, loss, tokens/s, elapsed and ETA (from the steps of this
    invocation, so a resumed run's ETA is right). When disabled nothing is drawn, and `write` goes to the
    log at INFO level instead of the terminal."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr, smoothing=0.1)

    def update(self, step: int, loss: float | None = None, tokens_per_s: float | None = None, **extra) -> None:
        if self.bar is None:
            return
        post = {}
        if loss is not None:
            post["loss"] = f"{loss:.4f}"
        if tokens_per_s is not None:
            post["tok/s"] = _fmt_rate(tokens_per_s)
        for k, v in extra.items():
            post[k] = f"{v:.4g}" if isinstance(v, float) else v
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(step - self.bar.n)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            log.info(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@dataclass
class StepStats:
    steps: int
    tokens: int
    step_time: float  # seconds per step (mean over the window)
    data_time: float  # seconds per step waiting for data (mean)
    tokens_per_s: float
    data_wait_pct: float


class StepTimer:
    """Wall time per step and the part of it spent waiting for data.

        timer = StepTimer(device)
        timer.start()                   # once, before the first step
        for ...:
            with timer.data_wait():
                batch = next(batches)
            ... step ...
            timer.step_done(tokens)     # synchronizes CUDA, then reads the clock
            if log_now: stats = timer.window()   # means since the last window(), then resets

    On CUDA the clock is read after torch.cuda.synchronize(), so a step's time includes its GPU work.
    Data wait is host time inside `data_wait()`, without synchronizing (the loader's own cost as seen by
    the training loop).
    """

    def __init__(self, device: torch.device | str | None = None):
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = dev.type == "cuda"
        self._t_last: float | None = None
        self._reset()

    def _reset(self) -> None:
        self._steps, self._tokens, self._time, self._data = 0, 0, 0.0, 0.0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start(self) -> None:
        self._sync()
        self._t_last = time.perf_counter()

    @contextlib.contextmanager
    def data_wait(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self._data += time.perf_counter() - t

    def step_done(self, tokens: int) -> float:
        """Close the current step; returns its wall time in seconds."""
        self._sync()
        now = time.perf_counter()
        if self._t_last is None:
            raise RuntimeError("StepTimer.step_done before start()")
        dt = now - self._t_last
        self._t_last = now
        self._steps += 1
        self._tokens += int(tokens)
        self._time += dt
        return dt

    def window(self) -> StepStats:
        n = max(self._steps, 1)
        t = max(self._time, 1e-12)
        s = StepStats(
            steps=self._steps,
            tokens=self._tokens,
            step_time=self._time / n,
            data_time=self._data / n,
            tokens_per_s=self._tokens / t if self._steps else 0.0,
            data_wait_pct=100.0 * self._data / t if self._steps else 0.0,
        )
        self._reset()
        return s


def peak_memory_gib(device: torch.device | str) -> float:
    """Peak memory in GiB: torch.cuda.max_memory_allocated on CUDA (tensors this process allocated on the
    device since the last reset_peak_memory_stats); otherwise the process' peak resident set size (host
    memory: everything the process holds, Python and libraries included)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20


def memory_scalars(device: torch.device | str) -> dict[str, float]:
    """Peak memory under a tag that says what was measured: memory/max_allocated_gib and
    memory/max_reserved_gib (CUDA) or memory/host_max_rss_gib (process resident set, on CPU)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {"memory/host_max_rss_gib": peak_memory_gib(dev)}
    # reserved: what the caching allocator holds (allocated + its slack), the figure an out-of-memory meets
    return {"memory/max_allocated_gib": peak_memory_gib(dev),
            "memory/max_reserved_gib": torch.cuda.max_memory_reserved(dev) / 2**30}
