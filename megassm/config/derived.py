"""Sizes the config implies (the blocks of a pattern, the mixers' widths, the world and data-parallel sizes),
shared by the checks, the models, the memory estimate and the planner."""
from __future__ import annotations

import os

from .sections import Config, ModelConfig, PATTERN_SEPARATORS


# ----------------------------------------------------------------------------------------------------
# Sizes derived from the config
# ----------------------------------------------------------------------------------------------------



def blocks_of(pattern: str) -> list[str]:
    """The residual blocks of a pattern, in order (stage separators dropped)."""
    return [c for c in pattern if c not in PATTERN_SEPARATORS]


def mamba_dims(model: ModelConfig) -> dict:
    d_inner = model.mamba.expand * model.d_model
    return {"d_inner": d_inner, "nheads": d_inner // model.mamba.headdim}


def scan_dims(model: ModelConfig, letter: str) -> dict:
    """d_inner and dt_rank of a selective-scan mixer: `S` (model.mamba1) or `L` (model.longhorn)."""
    sec = model.mamba1 if letter == "S" else model.longhorn
    rank = sec.dt_rank if sec.dt_rank is not None else -(-model.d_model // 16)
    return {"d_inner": sec.expand * model.d_model, "dt_rank": rank, "d_state": sec.d_state}


def ffn_hidden(model: ModelConfig) -> int:
    if model.mlp.ffn_hidden is not None:
        return model.mlp.ffn_hidden
    return -(-int(8 * model.d_model / 3) // 256) * 256


def attn_dims(model: ModelConfig) -> dict:
    a = model.attn
    head_dim = a.head_dim if a.head_dim is not None else model.d_model // a.n_heads
    return {"head_dim": head_dim, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads or a.n_heads}


def world_size(cfg: Config) -> int:
    if cfg.parallel.world_size is not None:
        return cfg.parallel.world_size
    return int(os.environ.get("WORLD_SIZE", "1"))


def data_parallel_size(cfg: Config) -> int:
    p = cfg.parallel
    return world_size(cfg) // (p.tp * p.cp * p.pp)
