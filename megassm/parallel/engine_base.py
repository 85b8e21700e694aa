"""The base of the data-parallel engines (`Engine`, also the plain DP = 1 stepping): in a module of its own so
that engines.py (the choice) imports the engines (fsdp2.py, deepspeed_engine.py, distopt.py) and they import
the base, never engines.py: imports run one way (docs/architecture.md, "Layers")."""
from __future__ import annotations

import contextlib

import torch

from megassm.config import Config

from .dp import allreduce_grads
from .state import ParallelGroups

__all__ = ["Engine"]


class Engine:
    """No data parallelism beyond what the other plans do (DP = 1), and the base of the engines: forward
    through the module, backward of loss / accum, clip over the canonical gradient, optimizer step."""

    name = "none"

    def __init__(self, model, groups: ParallelGroups, cfg: Config):
        self.model = model  # the (planned) model: parameters, names, param_groups
        self.module = model  # what the forward runs through
        self.groups = groups
        self.cfg = cfg
        self.optimizer = None

    def make_optimizer(self, build):
        self.optimizer = build()
        return self.optimizer

    def micro_batch(self, last: bool):
        return contextlib.nullcontext()

    def release(self) -> None:
        """Drop what an engine holds beyond a step (FSDP2: weights gathered by an evaluation forward)."""

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, accum: int) -> None:
        (loss / accum).backward()

    def reduce_grads(self) -> None:
        """The DP part of the gradient sync that the backward did not do (after the TP / PP / CP syncs)."""
        if self.groups.dp > 1:
            allreduce_grads(list(self.model.parameters()), self.groups.dp_group)

    def clip_grads(self, max_norm: float) -> float:
        """Norm of the canonical gradient (replicas counted once); scales the gradients to max_norm above it."""
        from .runtime import clip_grad_norm

        return clip_grad_norm(self.model, self.groups, max_norm)

    def clip_and_step(self, max_norm: float, check) -> float:
        """Clip to max_norm (norm of the canonical gradient), call check(norm), step the optimizer unless check
        declined, zero the gradients. Returns the norm. check(norm) may raise (a non-finite loss or norm: no step)
        or return False to decline the step (the spike guard's skip: gradients discarded, no optimizer step);
        None or True steps. Every rank must decide alike."""
        norm = self.clip_grads(max_norm)
        try:
            take = check(norm) is not False
        except BaseException:
            self.optimizer.zero_grad(set_to_none=self.grads_to_none)
            raise
        if take:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.grads_to_none)
        return norm

    # whether check() runs before the optimizer step, so that it can decline it (DeepSpeed steps first)
    declines_steps = True

    # after a step the gradients are freed (None) unless they live in buffers the engine keeps (DDP's buckets,
    # the distributed optimizer's buffer)
    grads_to_none = True

    # runtime.finish_grads: the DP reduction already ran in the backward, in place in the buffer the TP sum then
    # reads (the distributed optimizer's reduce-scatters): reduce_grads() waits for it before the TP sum
    reduced_in_backward = False
    # the DP reduction sums over the CP ranks too (the distributed optimizer's group is DP x CP): no CP all-reduce
    sums_cp = False

    # canonical checkpoint states: (None, None) = the trainer's TP/PP/plain path handles them
    handles_states = False

    def gather_states(self):
        return None, None

    def load_states(self, model_state: dict, optim_state: dict | None) -> None:
        raise NotImplementedError
