"""train.cast_weights_once: the matmul weights cast to bf16 once per optimizer step, not at every use.

Under bf16 autocast every Linear casts its fp32 weight to bf16 in the forward of every micro-batch, and its
backward casts the bf16 weight gradient back to fp32 before autograd adds it into `.grad`: per parameter and
micro-batch a 6-byte cast forward, a 6-byte cast backward and a 12-byte add (on a 3.5B-parameter TP 2 rank of
hybrid-7b, ~18 ms of a 224 ms micro-batch; docs/benchmarks.md). Here each Linear computes with a bf16 copy of
its weight (a leaf tensor, refreshed from the fp32 weight by one cast per optimizer step), and a hook adds its
bf16 gradient into the fp32 weight's `.grad` as it is produced (10 bytes per parameter and micro-batch).

Numerically the same as autocast: the copy is autocast's cast (round to nearest even), the weight gradient is
the same bf16 matmul output, and the fp32 sum of the micro-batches' gradients adds the same values in the same
order. The fp32 weights stay the parameters: the optimizer, clipping, the TP / CP / DP gradient paths and the
checkpoints see nothing new. The copies are not parameters or buffers (no state_dict entries).

Which modules: nn.Linear (swapped for `CachedLinear`, parallel/substitute.py) and the TP parallel Linears,
whose forwards read `weight_cache`. Refused where it cannot hold (training/checks.py): without bf16, with
FSDP2 / DeepSpeed (their own bf16 weights), PP, BPTT, and eager torch DDP over several ranks (its reducer
hooks wait for gradients on the parameters themselves, which autograd no longer produces).
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from megassm.parallel.layers import AlignedLinear, ColumnParallelLinear, RowParallelLinear, matmul_weight
from megassm.parallel.substitute import substitute
from megassm.parallel.tp import ReplicatedRowLinear

__all__ = ["CachedLinear", "WeightCache"]

log = logging.getLogger("megassm.train")

_READS_CACHE = (ColumnParallelLinear, RowParallelLinear, ReplicatedRowLinear, AlignedLinear)  # read `weight_cache`


class CachedLinear(nn.Linear):
    """nn.Linear computing with `weight_cache` (its weight's bf16 copy) when one is attached."""

    weight_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, matmul_weight(self), self.bias)


def _add_into(master: nn.Parameter, copy: torch.Tensor) -> None:
    """Post-accumulate hook of a bf16 copy: its gradient (fresh every backward) into the fp32 weight's .grad."""
    g = copy.grad
    copy.grad = None
    if master.grad is None:
        master.grad = g.to(master.dtype)  # the step's first micro-batch: autocast's backward cast
    else:
        master.grad.add_(g)  # later ones: autocast's cast + add in one


class WeightCache:
    """Attach bf16 copies to the model's Linears (in place); `refresh()` before a step's first forward."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        names = [n for n, m in model.named_modules() if n and type(m) is nn.Linear]
        for n in names:
            substitute(model, n, CachedLinear)
        for _, m in model.named_modules():
            if not isinstance(m, (CachedLinear, *_READS_CACHE)):
                continue
            w = m.weight
            if not w.requires_grad or w.dtype != torch.float32:
                continue
            copy = torch.empty_like(w, dtype=dtype).requires_grad_(True)
            copy.register_post_accumulate_grad_hook(functools.partial(_add_into, w))
            m.weight_cache = copy
            self.pairs.append((w, copy))
        self.refresh()
        log.info("train.cast_weights_once: %d Linear weights (%.1fM parameters) computed from bf16 copies cast "
                 "once per step", len(self.pairs), sum(p.numel() for p, _ in self.pairs) / 1e6)

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast every weight into its copy (in place: CUDA graphs read the same tensors), one foreach launch."""
        if self.pairs:
            torch._foreach_copy_([c for _, c in self.pairs], [w for w, _ in self.pairs])
