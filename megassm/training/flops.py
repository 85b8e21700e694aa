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

from megassm.config import ModelConfig, attn_dims, blocks_of, ffn_hidden, mamba_dims, scan_dims

log = logging.getLogger("megassm.flops")

__all__ = [
    "FLOP_KEYS",
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

FLOP_KEYS = ("embedding", "mamba_proj", "mamba_conv", "mamba_ssd", "attn_proj", "attn_scores", "mlp", "head")
FLOP_KEYS += ("coffee_proj", "coffee_scan", "bmojo_ssm", "bmojo_attn")
FLOP_KEYS += ("mamba1_proj", "mamba1_conv", "mamba1_scan", "longhorn_proj", "longhorn_conv", "longhorn_scan")


def causal_pairs(length: int, window: int = 0) -> int:
    """Number of (query, key) pairs with key <= query over `length` positions; with a sliding window W > 0
    each query sees at most its W most recent keys (itself included): sum over t = 1..L of min(t, W)."""
    if length <= 0:
        return 0
    if window <= 0 or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def ssd_flops(seq_len: int, chunk_size: int, nheads: int, headdim: int, ngroups: int, d_state: int) -> dict:
    """Forward FLOPs of one chunked SSD call over one sequence of `seq_len` tokens (chunk size Q, H heads
    of dim P, G groups of B/C, state size N). The last chunk may be partial.

    scores         C_t . B_s within a chunk, per group, for s <= t:        2 N G * pairs
    intra          (scores * decay) @ x within a chunk, per head:          2 P H * pairs
    chunk_state    sum_s decay_s B_s x_s^T at the end of each chunk:       2 P N H * L
    state_passing  h_c = exp(sum dA over chunk c) h_(c-1) + state_c:       2 P N H * n_chunks
    state_output   C_t . h_(c-1) (times the decay up to t), per head:      2 P N H * L
    with pairs = sum over chunks of q(q+1)/2 (q = that chunk's length).
    """
    L, Q, H, P, G, N = seq_len, chunk_size, nheads, headdim, ngroups, d_state
    n_full, rem = divmod(L, Q)
    n_chunks = n_full + (1 if rem else 0)
    pairs = n_full * causal_pairs(Q) + causal_pairs(rem)
    return {
        "scores": 2 * N * G * pairs,
        "intra": 2 * P * H * pairs,
        "chunk_state": 2 * P * N * H * L,
        "state_passing": 2 * P * N * H * n_chunks,
        "state_output": 2 * P * N * H * L,
    }


def _mamba_layer(m: ModelConfig, L: int) -> dict:
    mc = m.mamba
    dims = mamba_dims(m)
    d, di, H = m.d_model, dims["d_inner"], dims["nheads"]
    gn = mc.ngroups * mc.d_state
    in_out = 2 * di + 2 * gn + H  # z | x | B | C | dt
    conv_dim = di + 2 * gn
    ssd = ssd_flops(L, mc.chunk_size, H, mc.headdim, mc.ngroups, mc.d_state)
    return {
        "mamba_proj": 2 * L * d * in_out + 2 * L * di * d,
        "mamba_conv": 2 * L * mc.d_conv * conv_dim,
        "mamba_ssd": sum(ssd.values()),
    }


def _attn_layer(m: ModelConfig, L: int) -> dict:
    a = attn_dims(m)
    d, nh, nkv, hd = m.d_model, a["n_heads"], a["n_kv_heads"], a["head_dim"]
    proj = 2 * L * d * (nh * hd + 2 * nkv * hd) + 2 * L * nh * hd * d  # q, k, v, o
    # q.k and p.v: 2 hd each per (query, key) pair and query head (GQA shares k/v, not the FLOPs)
    scores = 2 * 2 * hd * nh * causal_pairs(L, m.attn.sliding_window)
    return {"attn_proj": proj, "attn_scores": scores}


def _mlp_layer(m: ModelConfig, L: int) -> dict:
    return {"mlp": 2 * L * 3 * m.d_model * ffn_hidden(m)}  # w1 (gate), w3 (up), w2 (down)


def _coffee_layer(m: ModelConfig, L: int) -> dict:
    """COFFEE (`C`): in/out projections d <-> D; per state element and token the recurrence
    x + sigmoid(w x) (lam x + u) is 3 multiply-adds and the readout C.x one (two with the +OF gate). The
    extra DEER Newton iterations are solver work, not model FLOPs (like recomputation)."""
    c = m.coffee
    D = c.expand * m.d_model if c.proj else m.d_model
    n = c.d_state
    proj = 2 * L * m.d_model * D * 2 if c.proj else 0
    return {"coffee_proj": proj, "coffee_scan": 2 * L * D * n * (3 + 1 + (1 if c.output_filter else 0))}


def _bmojo_layer(m: ModelConfig, L: int) -> dict:
    """B'MOJO (`B`): its Mamba-2 SSM (every term of `M`), and its attention: q/k/v/o on the L tokens, k/v on
    the n_fading SSM outputs of each of the ceil(L / w) chunks, scores over the w-token window
    (causal_pairs(L, w)) plus the m_f + m_e memory tokens of every query past the first chunk."""
    b = m.bmojo
    a = attn_dims(m)
    d, nh, nkv, hd = m.d_model, a["n_heads"], a["n_kv_heads"], a["head_dim"]
    W, mem = b.window, b.n_fading + b.n_eidetic
    n_fade = -(-L // W) * b.n_fading
    proj = 2 * L * d * (nh * hd + 2 * nkv * hd) + 2 * L * nh * hd * d + 2 * n_fade * d * 2 * nkv * hd
    pairs = causal_pairs(L, W) + max(L - W, 0) * mem
    return {"bmojo_ssm": sum(_mamba_layer(m, L).values()), "bmojo_attn": proj + 2 * 2 * hd * nh * pairs}


def _scan_layer(m: ModelConfig, L: int, letter: str) -> dict:
    """Mamba-1 (`S`) / Longhorn (`L`): in_proj d -> 2 Di, x_proj Di -> R + 2N, dt_proj (beta_proj) R -> Di,
    out_proj Di -> d; the depthwise conv; per (token, channel, state) the scan: decay argument (dt A, or
    eps k^2 and 1 - that), input (dt x) B, update a h + b (2) and readout C . h (2): 6 FLOPs for S, 7 for L.
    The exp, softplus / sigmoid, |k|^2 and eps are elementwise over [L, Di] or [L, N] (not counted)."""
    dims = scan_dims(m, letter)
    d, di, R, N = m.d_model, dims["d_inner"], dims["dt_rank"], dims["d_state"]
    sec, key = (m.mamba1, "mamba1") if letter == "S" else (m.longhorn, "longhorn")
    proj = 2 * L * d * 2 * di + 2 * L * di * (R + 2 * N) + 2 * L * R * di + 2 * L * di * d
    return {f"{key}_proj": proj, f"{key}_conv": 2 * L * sec.d_conv * di,
            f"{key}_scan": L * di * N * (6 if letter == "S" else 7)}


_LAYERS = {"M": _mamba_layer, "*": _attn_layer, "-": _mlp_layer}
_LAYERS.update({"C": _coffee_layer, "B": _bmojo_layer})
_LAYERS.update({"S": lambda m, L: _scan_layer(m, L, "S"), "L": lambda m, L: _scan_layer(m, L, "L")})


def flops_per_sequence(model_cfg: ModelConfig, vocab_padded: int, seq_len: int) -> dict[str, int]:
    """Forward FLOPs of one sequence of `seq_len` tokens through the whole model, by layer type (summed
    over the blocks of the pattern): the keys of FLOP_KEYS (types absent from the pattern are 0) and
    "total". Exact integers. Multiply "total" by 3 for a training step (backward = 2 x forward)."""
    out = {k: 0 for k in FLOP_KEYS}
    L = int(seq_len)
    per_letter: dict[str, dict] = {}
    for c in blocks_of(model_cfg.pattern):
        if c not in _LAYERS:
            raise ValueError(f"flops: no FLOP count for pattern letter '{c}' (known: {', '.join(_LAYERS)})")
        if c not in per_letter:
            per_letter[c] = _LAYERS[c](model_cfg, L)
        for k, v in per_letter[c].items():
            out[k] += v
    out["head"] = 2 * L * model_cfg.d_model * int(vocab_padded)
    out["embedding"] = 0  # a lookup
    out["total"] = sum(out[k] for k in FLOP_KEYS)
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
