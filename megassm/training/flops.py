"""FLOPs counted per layer type from the model config, and MFU. docs/flops.md gives every formula.

    fl = flops_per_sequence(cfg.model, vocab_padded, seq_len)   # forward FLOPs of one sequence, by type
    train_per_token = 3 * fl["total"] / seq_len                 # = train_flops_per_token(...)
    util = mfu(tokens_per_s, train_per_token, peak_flops_for(device))   # fraction of peak, or None

Conventions (docs/flops.md): a multiply-add is 2 FLOPs; matrix products only (elementwise work — norms,
activations, gating, softplus/exp/cumsum of dt, the D skip, biases, RoPE, softmax — is not counted);
causal terms count the (query, key) pairs that are actually needed, the lower triangle with its
diagonal (L(L+1)/2, not L^2/2 and not L^2); document masks are ignored (the whole sequence is one
document for counting); training = 3 x forward; activation recomputation is not counted (model FLOPs).
"""
from __future__ import annotations

import logging
import os
import re

import torch

from megassm.config import ModelConfig, blocks_of
from megassm.models.registry import block_kind, block_kinds, causal_pairs, ssd_flops

log = logging.getLogger("megassm.flops")

__all__ = [
    "FLOP_KEYS",
    "flop_keys",
    "flops_per_sequence",
    "ssd_flops",
    "causal_pairs",
    "train_flops_per_token",
    "params_flops_6nd",
    "mfu",
    "peak_flops_for",
    "peak_flops_for_name",
    "PEAK_BF16_DENSE",
]

# the per-layer formulas live with each block kind (models/registry.py: `flops`, `flop_keys`, in the mixer's
# file); causal_pairs and ssd_flops, shared by several, in the registry
def flop_keys() -> tuple:
    """embedding, every registered kind's keys (registry order), head."""
    return ("embedding",) + tuple(k for kind in block_kinds() for k in kind.flop_keys) + ("head",)


FLOP_KEYS = flop_keys()


def flops_per_sequence(model_cfg: ModelConfig, vocab_padded: int, seq_len: int) -> dict[str, int]:
    """Forward FLOPs of one sequence of `seq_len` tokens through the whole model, by layer type (summed
    over the blocks of the pattern): the keys of FLOP_KEYS (types absent from the pattern are 0) and
    "total". Exact integers. Multiply "total" by 3 for a training step (backward = 2 x forward)."""
    keys = flop_keys()
    out = {k: 0 for k in keys}
    L = int(seq_len)
    per_letter: dict[str, dict] = {}
    for c in blocks_of(model_cfg.pattern):
        kind = block_kind(c)
        if kind.flops is None:
            raise ValueError(f"flops: no FLOP count for pattern letter '{c}' ({kind.name})")
        if c not in per_letter:
            per_letter[c] = kind.flops(model_cfg, L)
        for k, v in per_letter[c].items():
            out[k] += v
    out["head"] = 2 * L * model_cfg.d_model * int(vocab_padded)
    out["embedding"] = 0  # a lookup
    out["total"] = sum(out[k] for k in keys)
    return out


def train_flops_per_token(model_cfg: ModelConfig, vocab_padded: int, seq_len: int) -> float:
    """Model FLOPs of one training token: 3 x forward (backward = 2 x forward), at this sequence length."""
    return 3.0 * flops_per_sequence(model_cfg, vocab_padded, seq_len)["total"] / seq_len


def params_flops_6nd(n_params: int) -> float:
    """The 6 N approximation: training FLOPs per token for N parameters (MFU as benchmarks/peers.py counts it)."""
    return 6.0 * n_params


def mfu(tokens_per_s: float, flops_per_token_train: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilization as a fraction of peak (0.42 = 42%); None when the peak is unknown."""
    if not peak_flops:
        return None
    return tokens_per_s * flops_per_token_train / peak_flops


# Dense (no sparsity) bf16 tensor-core peak per GPU, FLOP/s, from the vendors' data sheets. Matched in
# order against torch.cuda.get_device_name(): the first key found in the name as a whole word
# (case-insensitive; "A40" does not match "RTX A4000", "B200" does not match "GB200").
PEAK_BF16_DENSE: list[tuple[str, float]] = [
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A40", 150e12),
    ("RTX A6000", 155e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
    ("MI250X", 383e12),
]


def peak_flops_for_name(name: str) -> float | None:
    """bf16 dense peak of a GPU by its name (as torch.cuda.get_device_name gives it), or None."""
    for key, peak in PEAK_BF16_DENSE:
        if re.search(r"(?<![A-Za-z0-9])" + re.escape(key) + r"(?![A-Za-z0-9])", name, flags=re.IGNORECASE):
            return peak
    return None


def peak_flops_for(device: torch.device | str | None) -> float | None:
    """bf16 dense peak FLOP/s of `device`; None on CPU or for a GPU not in PEAK_BF16_DENSE (then MFU is not
    reported). The environment variable MEGASSM_PEAK_FLOPS (e.g. 989e12) overrides the table."""
    env = os.environ.get("MEGASSM_PEAK_FLOPS")
    if env:
        return float(env)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(dev)
    peak = peak_flops_for_name(name)
    if peak is not None:
        return peak
    log.warning("no bf16 peak FLOP/s known for GPU '%s'; MFU not reported (set MEGASSM_PEAK_FLOPS)", name)
    return None
