"""train.fp8: the model's projections computed in FP8 (kernels/fp8/op.py), opt-in.

Every nn.Linear of the blocks whose sizes torch._scaled_mm takes (in and out features multiples of 16) becomes
an `FP8Linear`: the same module (parameters, names, init, checkpoints unchanged; parallel/substitute.py) whose
forward is `kernels.fp8_linear`. The master weights, the optimizer, the gradient paths and the checkpoints
see nothing new: only the three matmuls of each projection change precision. Kept in bf16, and logged: the LM
head (the logits' precision is the loss's), and any Linear whose sizes fail the multiple-of-16 rule (e.g. a
Mamba-1 x_proj of dt_rank + 2 N columns).

The weights' FP8 operands (E4M3 W, its transpose for dx, the scale) are cast once per optimizer step where the
weights are whole fp32 tensors on every rank (one process, the ddp engine with or without its distributed
optimizer): `FP8WeightCache.refresh()` before the step's first micro-batch and before evaluation, in place (CUDA
graphs replay the same tensors), 2 bytes per parameter held. Under FSDP2 the weights exist whole only inside each
forward, so every call casts them.

Tensor parallelism: the column-parallel Linears are plain nn.Linears holding their rows (swapped as above), and
the row-parallel ones (`RowParallelLinear`) become `FP8RowParallelLinear`: the local product in FP8, then the
same all-reduce (SP: reduce-scatter) of its bf16 output. Each rank scales its own shard of x and W, so TP's
quantization is per shard, not per whole tensor: close to one process's, not bit for bit. Kept in bf16: TP's
entry Linear under parallel.tp_overlap (its fused autograd function: refused in checks.py), and the replicated
row Linears (Mamba-1 / Longhorn x_proj).

Refused where it is not built (training/checks.py): without bf16 autocast, with parallel.tp_overlap, with FSDP2
x TP, with train.cast_weights_once (both replace the Linears' weight path), and with the DeepSpeed engine.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from megassm.kernels.fp8 import E4M3, fp8_eligible, fp8_linear, fp8_weight
from megassm.parallel.layers import RowParallelLinear, region_out
from megassm.parallel.substitute import substitute

__all__ = ["FP8Linear", "FP8RowParallelLinear", "FP8WeightCache", "apply_fp8", "fp8_plan"]

log = logging.getLogger("megassm.train")


class FP8Linear(nn.Linear):
    """nn.Linear whose matmuls run in FP8 with per-tensor dynamic scales (kernels/fp8/op.py); with `fp8_weight` set
    (FP8WeightCache), from the weight's operands cast once per step."""

    fp8_weight: tuple | None = None

    def forward(self, x):
        return fp8_linear(x, self.weight, self.bias, self.fp8_weight)


class FP8RowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose local product runs in FP8 (this rank's shards of x and W, scaled apart); the
    reduction over the TP group and the bias as before."""

    fp8_weight: tuple | None = None

    def forward(self, x):
        y = region_out(fp8_linear(x, self.weight, None, self.fp8_weight), self.tp_group, self.sp and x.dim() == 3)
        return y if self.bias is None else y + self.bias


_FP8_MODULES = (FP8Linear, FP8RowParallelLinear)


class FP8WeightCache:
    """The FP8Linears' weight operands, cast once per optimizer step (module docstring). `refresh()` after every
    change of the weights and before they are used (the trainer: at each step's start and before evaluation)."""

    def __init__(self, model: nn.Module):
        self.mods = [m for m in model.modules() if isinstance(m, _FP8_MODULES)]
        for m in self.mods:
            n, k = m.weight.shape
            dev = m.weight.device
            m.fp8_weight = (torch.empty(n, k, dtype=E4M3, device=dev), torch.empty(k, n, dtype=E4M3, device=dev),
                            torch.empty((), dtype=torch.float32, device=dev))
        self.refresh()
        log.info("train.fp8: the weights of %d Linears cast to FP8 once per optimizer step", len(self.mods))

    @torch.no_grad()
    def refresh(self) -> None:
        for m in self.mods:
            fp8_weight(m.weight.detach(), out=m.fp8_weight)


_SWAP = {nn.Linear: FP8Linear, RowParallelLinear: FP8RowParallelLinear}


def fp8_plan(model: nn.Module) -> tuple[dict, dict]:
    """Which Linears of `model` train.fp8 computes in FP8: ({name: FP8 class}, {name: why kept in bf16}). Shared by
    apply_fp8 and the memory estimate (training/memory.py)."""
    head = getattr(model, "lm_head", None)
    swaps, kept = {}, {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        n_out, n_in = m.weight.shape  # this rank's shard under TP
        if m is head:
            kept[name] = "the LM head stays in bf16"
        elif type(m) not in _SWAP:
            kept[name] = f"{type(m).__name__}: its own autograd path, not built for FP8"
        elif not fp8_eligible(n_in, n_out):
            kept[name] = f"{n_in} -> {n_out}: not multiples of 16"
        else:
            swaps[name] = _SWAP[type(m)]
    return swaps, kept


def apply_fp8(model: nn.Module) -> dict:
    """Swap the eligible Linears of `model` for their FP8 classes, in place (`fp8_plan`). Returns
    {"fp8": names, "kept": {name: why}}."""
    swaps, kept = fp8_plan(model)
    for name, cls in swaps.items():
        substitute(model, name, cls)
    done = list(swaps)
    n = sum(model.get_submodule(x).weight.numel() for x in done)
    log.info("train.fp8: %d Linears (%.1fM parameters) compute in FP8 (E4M3 forward, E5M2 gradients, per-tensor "
             "dynamic scales); %d kept in bf16%s", len(done), n / 1e6, len(kept),
             "" if not kept else ": " + "; ".join(f"{k} ({v})" for k, v in list(kept.items())[:6])
             + (" ..." if len(kept) > 6 else ""))
    return {"fp8": done, "kept": kept}
