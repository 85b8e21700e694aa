"""Optimizer, learning-rate schedule and gradient clipping.

    opt = build_optimizer(model.param_groups(cfg.optim.weight_decay), cfg.optim, device.type)
    sched = LRScheduler(opt, cfg.optim, total_steps=cfg.train.steps)
    for step in range(start, total):
        lr = sched.step_to(step)          # sets group["lr"] = lr * group.get("lr_scale", 1.0)
        ... backward ...
        norm = clip_grad_norm(model.parameters(), cfg.train.grad_clip)
        opt.step(); opt.zero_grad(set_to_none=True)

The schedule is a pure function of (step, config, total steps): `lr_at`. Resuming at step k therefore
gives exactly the learning rates an uninterrupted run would have used; the scheduler's state dict only
records where it was, for checks and for humans.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

from megassm.config import OptimConfig
from megassm.parallel.clipping import clip_grad_norm  # noqa: F401  (re-exported: the trainer's entry)

log = logging.getLogger("megassm.optim")

__all__ = ["build_optimizer", "lr_at", "LRScheduler", "clip_grad_norm"]


def _use_fused(cfg: OptimConfig, device_type: str) -> bool:
    if cfg.fused == "true":
        return True
    if cfg.fused == "false":
        return False
    if cfg.fused == "auto":
        return device_type == "cuda"
    raise ValueError(f"optim.fused must be auto, true or false, got '{cfg.fused}'")


def build_optimizer(param_groups: list[dict], cfg: OptimConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW over the model's parameter groups.

    `param_groups`: dicts with "params" and "weight_decay" (and optionally "lr_scale", "name", ... which
    torch keeps in the group and in the state dict). Groups without parameters are dropped. The initial
    lr is cfg.lr (times "lr_scale"); the scheduler overwrites it before every step.
    Implementation: fused when cfg.fused == "true", or "auto" on CUDA; otherwise the foreach
    (multi-tensor) implementation. The choice is logged.
    """
    groups = []
    for i, g in enumerate(param_groups):
        if "params" not in g:
            raise ValueError(f"parameter group {i} has no 'params' key (keys: {sorted(g)})")
        params = list(g["params"])
        if not params:
            log.debug("dropping empty parameter group %d (%s)", i, g.get("name", ""))
            continue
        g = dict(g)
        g["params"] = params
        g.setdefault("weight_decay", cfg.weight_decay)
        g.setdefault("lr_scale", 1.0)
        g["lr"] = cfg.lr * g["lr_scale"]
        groups.append(g)
    if not groups:
        raise ValueError("build_optimizer: no parameters to optimize")
    fused = _use_fused(cfg, device_type)
    kwargs = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, **kwargs
    )
    n = [sum(p.numel() for p in g["params"]) for g in opt.param_groups]
    log.info(
        "AdamW (%s, optim.fused=%s, device %s): betas (%g, %g), eps %g; groups: %s",
        "fused" if fused else "foreach", cfg.fused, device_type, cfg.beta1, cfg.beta2, cfg.eps,
        ", ".join(f"{c / 1e6:.3f}M params wd {g['weight_decay']:g}" for c, g in zip(n, opt.param_groups)),
    )
    return opt


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for the optimizer step with 0-based index `step` (the number of steps already taken).

    - warmup: lr * (step + 1) / warmup_steps for step < warmup_steps (the first step is not lr 0);
    - then decay over steps warmup_steps .. total_steps from lr to min_lr (reached at step == total_steps,
      held after): cosine  min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2,
                    linear  min_lr + (lr - min_lr) * (1 - p),
                    constant lr,
      with p = (step - warmup_steps) / (total_steps - warmup_steps) clamped to [0, 1].
    Never below min_lr after warmup. Pure function: resume is exact.
    """
    if step < 0:
        raise ValueError(f"lr_at: step must be >= 0, got {step}")
    warmup = cfg.warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.decay == "constant":
        return cfg.lr
    span = total_steps - warmup
    p = 1.0 if span <= 0 else min(max((step - warmup) / span, 0.0), 1.0)
    if cfg.decay == "cosine":
        frac = 0.5 * (1.0 + math.cos(math.pi * p))
    elif cfg.decay == "linear":
        frac = 1.0 - p
    else:
        raise ValueError(f"optim.decay must be cosine, linear or constant, got '{cfg.decay}'")
    return max(cfg.min_lr + (cfg.lr - cfg.min_lr) * frac, cfg.min_lr)


class LRScheduler:
    """Sets every group's lr from `lr_at` (times the group's "lr_scale", default 1).

    `step_to(step)` sets the lr for optimizer step `step` and returns the base lr; `step()` does the same
    for the internal counter and advances it (torch-style use). The state dict holds the counter and the
    schedule's settings; loading it re-applies the lr of the current counter to the groups.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
        self.optimizer = optimizer
        self.cfg = cfg
        self.total_steps = int(total_steps)
        self.next_step = 0  # the step the next call to step() sets the lr for
        self.last_lr: float | None = None

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.cfg, self.total_steps)

    def step_to(self, step: int) -> float:
        lr = self.lr_at(step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        self.last_lr = lr
        self.next_step = step + 1
        return lr

    def step(self) -> float:
        return self.step_to(self.next_step)

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def _settings(self) -> dict:
        return {"total_steps": self.total_steps, **{k: v for k, v in dataclasses.asdict(self.cfg).items()
                                                    if k in ("lr", "min_lr", "warmup_steps", "decay")}}

    def state_dict(self) -> dict:
        return {"next_step": self.next_step, "last_lr": self.last_lr, **self._settings()}

    def load_state_dict(self, state: dict) -> None:
        saved = {k: state.get(k) for k in self._settings()}
        now = self._settings()
        if saved != now:
            diff = ", ".join(f"{k}: {saved[k]} -> {now[k]}" for k in now if saved[k] != now[k])
            log.warning("learning-rate schedule changed since the checkpoint (%s); following the new one", diff)
        self.next_step = int(state["next_step"])
        if self.next_step > 0:
            self.step_to(self.next_step - 1)  # the groups carry the lr of the last step taken, as saved
            self.next_step = int(state["next_step"])
