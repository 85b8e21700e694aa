"""Canonical initialization: every parameter is a function of (seed, parameter name) only.

Each module declares, next to its parameters, a dict `init_rules` {local parameter name: InitRule}. The
model's `init_weights(seed)` walks `named_parameters()`, draws each tensor at its full (single-device,
checkpoint-layout) shape in fp32 on the CPU from its own `torch.Generator` seeded by hashing
(seed, full parameter name), and copies it into the parameter. So the same seed gives the same weights
whatever the device, dtype, construction order or (later) parallel layout: a sharded parameter takes its
slice of the same canonical tensor.

The rules also carry the optimizer policy (`no_wd`: no weight decay). Rules live on the modules, not on the
Parameter objects, because `Module.to_empty()` (meta -> real device) replaces Parameter objects and would
drop attributes set on them; `init_weights` re-marks `param._no_weight_decay` for tools that look for it.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["InitRule", "param_seed", "draw", "rule_of", "canonical_init",
           "canonical_parameter", "no_weight_decay_names", "make_linear"]


@dataclass(frozen=True)
class InitRule:
    """kind: normal(std) | zeros | ones | uniform(low, high) | A_log(low, high): log U[low, high] |
    dt_bias(low, high, floor): softplus^-1(dt), dt log-uniform in [low, high] floored at `floor` |
    logit_uniform(low, high): logit(v), v ~ U[low, high] in (0, 1) (a parameter read through a sigmoid) |
    s4d_real: log(1..N) along the last dim, the same in every row (A = -exp(A_log) = -(n+1), Mamba-1's S4D-real)."""

    kind: str
    std: float = 0.0
    low: float = 0.0
    high: float = 0.0
    floor: float = 0.0
    no_wd: bool = False


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, parameter name), stable across processes and platforms."""
    digest = hashlib.sha256(f"megassm-init:{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def draw(rule: InitRule, shape, gen: torch.Generator) -> torch.Tensor:
    """The canonical fp32 CPU tensor for one parameter."""
    t = torch.empty(shape, dtype=torch.float32)
    k = rule.kind
    if k == "normal":
        return t.normal_(0.0, rule.std, generator=gen)
    if k == "zeros":
        return t.zero_()
    if k == "ones":
        return t.fill_(1.0)
    if k == "uniform":
        return t.uniform_(rule.low, rule.high, generator=gen)
    if k == "A_log":
        return torch.log(t.uniform_(rule.low, rule.high, generator=gen))
    if k == "dt_bias":
        u = t.uniform_(0.0, 1.0, generator=gen)
        dt = torch.exp(u * (math.log(rule.high) - math.log(rule.low)) + math.log(rule.low))
        dt = dt.clamp(min=rule.floor)
        return dt + torch.log(-torch.expm1(-dt))  # inverse of softplus
    if k == "s4d_real":
        return torch.log(torch.arange(1, shape[-1] + 1, dtype=torch.float32)).expand(shape).contiguous()
    if k == "logit_uniform":
        v = t.uniform_(rule.low, rule.high, generator=gen)
        return torch.log(v) - torch.log1p(-v)
    raise ValueError(f"unknown init rule {k!r}")


def rule_of(model: nn.Module, name: str) -> InitRule:
    mod_name, _, local = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    rules = getattr(mod, "init_rules", None)
    if rules is None or local not in rules:
        raise KeyError(f"parameter '{name}' has no init rule (add it to {type(mod).__name__}.init_rules)")
    return rules[local]


def canonical_parameter(model: nn.Module, name: str, shape, seed: int) -> torch.Tensor:
    """The canonical fp32 CPU value of parameter `name` (full single-device `shape`) for `seed`. A parallel
    plan that shards a parameter initializes its shard as the matching slice of this tensor."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(param_seed(seed, name))
    return draw(rule_of(model, name), tuple(shape), gen)


@torch.no_grad()
def canonical_init(model: nn.Module, seed: int) -> None:
    for name, p in model.named_parameters():
        if p.is_meta:
            raise RuntimeError(
                f"init_weights: parameter '{name}' is on the meta device; materialize the model first "
                "(model.to_empty(device=...)), then call init_weights(seed)"
            )
        p.copy_(canonical_parameter(model, name, p.shape, seed))
        p._no_weight_decay = rule_of(model, name).no_wd


def no_weight_decay_names(model: nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters() if rule_of(model, name).no_wd}


def make_linear(in_features: int, out_features: int, bias: bool, std: float) -> nn.Linear:
    """nn.Linear whose canonical init is normal(0, std) for the weight and zeros for the bias (no WD)."""
    lin = nn.Linear(in_features, out_features, bias=bias)
    lin.init_rules = {"weight": InitRule("normal", std=std), "bias": InitRule("zeros", no_wd=True)}
    return lin
