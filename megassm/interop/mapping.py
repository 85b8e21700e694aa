"""Parameter names and configs: megassm <-> transformers (Mamba2ForCausalLM, NemotronHForCausalLM,
GraniteMoeHybridForCausalLM); mamba_ssm's checkpoints in mamba_ssm.py.

Pure functions over state dicts and config dicts (torch and megassm.config only): no files, no transformers
import. `export_target(model_cfg)` says which transformers architecture computes exactly what the model does,
or raises NotExportable naming, on one line, every block (index and letter) or option it cannot express and the
keys to train with instead.

    target = export_target(cfg.model)                           # "mamba2" | "nemotron_h" | "granitemoehybrid"
    hf_config, hf_state = to_hf(state, cfg.model, target, vocab_padded)
    model_cfg, state = from_hf(hf_config, hf_state)             # back to megassm names and a ModelConfig

The tensors are the same objects (or reshaped views, or for GraniteMoeHybrid's fused MLP input the
concatenation of w1 and w3) as the input: no value is changed, so export -> import -> export is bit-identical.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from megassm.config import ModelConfig, attn_dims, blocks_of, ffn_hidden, mamba_dims

__all__ = ["NotExportable", "MappingError", "export_target", "to_hf", "from_hf", "HF_ARCH",
           "config_differences", "FOREIGN_KEYS"]

HF_ARCH = {"mamba2": "Mamba2ForCausalLM", "nemotron_h": "NemotronHForCausalLM",
           "granitemoehybrid": "GraniteMoeHybridForCausalLM"}
# layers_block_type names of transformers >= 5 (older releases said mamba / attention; both are read back)
_NEMOTRON_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
_INF = float("inf")


class NotExportable(ValueError):
    """The model has no exact counterpart in the target (the message names the block or key and why)."""


class MappingError(ValueError):
    """A source directory's config or weights cannot be read as a megassm model (names the key)."""


# ----------------------------------------------------------------------------------------------------
# what can be exported
# ----------------------------------------------------------------------------------------------------
_NO_COUNTERPART = {
    "C": "COFFEE has no transformers implementation",
    "B": "B'MOJO has no transformers implementation",
    "L": "Longhorn has no transformers implementation",
    "S": "Mamba-1 (`S`) blocks carry no norm/gate layout of transformers' Mamba-2 classes, and no transformers "
         "architecture mixes Mamba-1 blocks with these",
}
# hybrid classes in the order they are preferred when several compute the function exactly: Nemotron-H first (one
# transformers block per letter, so a relu2 hybrid keeps the class it always had), then GraniteMoeHybrid
_HYBRIDS = ("nemotron_h", "granitemoehybrid")


def _mamba_refusals(m: ModelConfig) -> list[tuple[str, str]]:
    """(why, the key that fixes it) of each option of `M` blocks transformers' Mamba-2 mixers lack."""
    mc = m.mamba
    out = []
    if mc.D_has_hdim:
        out.append(("model.mamba.D_has_hdim=true (D per channel), where the Mamba-2 mixers of Mamba2ForCausalLM, "
                    "NemotronHForCausalLM and GraniteMoeHybridForCausalLM have D per head",
                    "model.mamba.D_has_hdim=false"))
    if mc.norm_before_gate:
        out.append(("model.mamba.norm_before_gate=true, where the Mamba-2 mixers of Mamba2ForCausalLM, "
                    "NemotronHForCausalLM and GraniteMoeHybridForCausalLM gate before the norm",
                    "model.mamba.norm_before_gate=false"))
    return out


def granite_layers(pattern: str) -> list[tuple[int, int | None]] | int:
    """GraniteMoeHybrid layers of a pattern: (mixer block, its `-` block or None) per layer, each layer being one
    mixer (`M` or `*`) then one MLP; or the index of the first `-` that does not directly follow a mixer."""
    layers: list[list] = []
    for i, k in enumerate(blocks_of(pattern)):
        if k == "-":
            if not layers or layers[-1][1] is not None or i != layers[-1][0] + 1:
                return i
            layers[-1][1] = i
        else:
            layers.append([i, None])
    return [(a, b) for a, b in layers]


def _refusals(m: ModelConfig, target: str) -> dict:
    """why -> [letter, block indices, the key that fixes it or None] of everything `target` cannot express."""
    found: dict[str, list] = {}

    def refuse(i: int, k: str, why: str, fix: str | None = None) -> None:
        found.setdefault(why, [k, [], fix])[1].append(i)

    kinds, a = blocks_of(m.pattern), m.attn
    for i, k in enumerate(kinds):
        if k in _NO_COUNTERPART:
            refuse(i, k, _NO_COUNTERPART[k] + ", nothing to export it to")
        elif k == "M":
            for why, fix in _mamba_refusals(m):
                refuse(i, k, why, fix)
        elif k == "*" and a.sliding_window:
            refuse(i, k, f"sliding-window attention (model.attn.sliding_window={a.sliding_window}), where "
                         "NemotronHForCausalLM and GraniteMoeHybridForCausalLM attend to every earlier token",
                   "model.attn.sliding_window=0")
    if target == "nemotron_h":
        for i, k in enumerate(kinds):
            if k == "*" and a.rope:
                refuse(i, k, "attention uses RoPE (model.attn.rope=true), where NemotronHForCausalLM's attention "
                             "has no positional encoding", "model.attn.rope=false")
            if k == "*" and a.bias:
                refuse(i, k, "model.attn.bias=true, where NemotronHForCausalLM's q/k/v/o projections have no bias",
                       "model.attn.bias=false")
            if k == "-" and m.mlp.activation != "relu2":
                refuse(i, k, f"model.mlp.activation={m.mlp.activation}, where NemotronHForCausalLM's MLP is a "
                             "squared ReLU without a gate", "model.mlp.activation=relu2")
    elif target == "granitemoehybrid":
        for i, k in enumerate(kinds):
            if k == "-" and m.mlp.activation != "swiglu":
                refuse(i, k, f"model.mlp.activation={m.mlp.activation}, where GraniteMoeHybridForCausalLM's MLP is "
                             "SwiGLU", "model.mlp.activation=swiglu")
            if k == "-" and m.mlp.bias:
                refuse(i, k, "model.mlp.bias=true, where GraniteMoeHybridForCausalLM's MLP has no bias",
                       "model.mlp.bias=false")
        bad = granite_layers(m.pattern)
        if isinstance(bad, int):
            refuse(bad, "-", "an MLP that does not directly follow an M or * block, where each "
                             "GraniteMoeHybridForCausalLM layer is one mixer then one MLP (model.pattern)")
    return found


def export_target(m: ModelConfig) -> str:
    """'mamba2' for a pattern of `M` blocks only; for `M` / `*` / `-` hybrids the first of 'nemotron_h',
    'granitemoehybrid' that computes the same function; otherwise NotExportable, one line naming every reason
    (its first block by index and letter, and how many more; a reason names the class it is about) and the keys
    to train with instead for the class that needs fewest, so that one retraining is enough."""
    hybrid = set(blocks_of(m.pattern)) != {"M"}
    targets = _HYBRIDS if hybrid else ("mamba2",)
    found = {t: _refusals(m, t) for t in targets}
    for t in targets:
        if not found[t]:
            return t
    merged: dict[str, list] = {}
    for t in targets:
        for why, rec in found[t].items():
            merged.setdefault(why, rec)
    parts = []
    for why, (k, where, _) in sorted(merged.items(), key=lambda item: item[1][1][0]):  # by first block
        more = f" (and {len(where) - 1} more block{'s' if len(where) > 2 else ''})" if len(where) > 1 else ""
        parts.append(f"block {where[0]} '{k}': {why}{more}")
    fixable = [(len(f), t, f) for t, f in ((t, [fix for _, _, fix in found[t].values()]) for t in targets)
               if all(f)]
    if fixable:
        _, t, fixes = min(fixable, key=lambda x: (x[0], targets.index(x[1])))
        instead = f"To export, train with {' '.join(dict.fromkeys(fixes))} ({HF_ARCH[t]})"
    else:
        instead = f"Only M, * and - blocks export ({', '.join(HF_ARCH.values())})"
    raise NotExportable(f"model.pattern {m.pattern!r} has no exact transformers counterpart: {'; '.join(parts)}. "
                        f"{instead}; docs/interop.md \"What is refused\"")


# ----------------------------------------------------------------------------------------------------
# megassm -> transformers
# ----------------------------------------------------------------------------------------------------
def _dt_limit(m: ModelConfig) -> list[float]:
    return [0.0, _INF] if m.mamba.dt_limit is None else [float(x) for x in m.mamba.dt_limit]


def _mamba_config(m: ModelConfig, prefix: str = "") -> dict:
    mc, dims = m.mamba, mamba_dims(m)
    return {
        f"{prefix}num_heads": dims["nheads"], f"{prefix}head_dim": mc.headdim, "n_groups": mc.ngroups,
        "expand": mc.expand, "conv_kernel": mc.d_conv, "use_conv_bias": mc.conv_bias, "use_bias": mc.proj_bias,
        "chunk_size": mc.chunk_size, "time_step_limit": _dt_limit(m), "time_step_min": mc.dt_min,
        "time_step_max": mc.dt_max, "time_step_floor": mc.dt_init_floor,
    }


# GraniteMoeHybrid layer types as vLLM's implementation keys them (vllm/model_executor/models/granitemoehybrid.py);
# transformers >= 5 reads them as linear_attention / full_attention (configuration_utils._LEGACY_LAYER_TYPE_REMAP)
GRANITE_TYPES = {"M": "mamba", "*": "attention"}


def _granite_config(m: ModelConfig, vocab_padded: int, max_positions: int | None) -> dict:
    """GraniteMoeHybridConfig kwargs: a dense model (no experts), every multiplier 1 and the attention scale
    1/sqrt(head_dim), so that each layer is exactly x + mixer(norm(x)), then x + swiglu(norm(x))."""
    kinds, mc, dims = blocks_of(m.pattern), m.mamba, mamba_dims(m)
    layers = granite_layers(m.pattern)
    # a pattern without `-` gets zero-width MLPs: transformers' Linear(d, 0) -> Linear(0, d) gives exact zeros and
    # vLLM skips shared_intermediate_size == 0; with `-` blocks, a mixer with none after it gets an all-zero MLP
    ffn = ffn_hidden(m) if "-" in kinds else 0
    cfg = {"vocab_size": vocab_padded, "hidden_size": m.d_model, "rms_norm_eps": m.norm_eps,
           "initializer_range": m.init_std, "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu",
           "num_hidden_layers": len(layers), "layer_types": [GRANITE_TYPES[kinds[b]] for b, _ in layers],
           "num_local_experts": 0, "shared_intermediate_size": ffn, "intermediate_size": ffn,
           "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
           "mamba_n_heads": dims["nheads"], "mamba_d_head": mc.headdim, "mamba_n_groups": mc.ngroups,
           "mamba_d_state": mc.d_state, "mamba_d_conv": mc.d_conv, "mamba_expand": mc.expand,
           "mamba_chunk_size": mc.chunk_size, "mamba_conv_bias": mc.conv_bias, "mamba_proj_bias": mc.proj_bias,
           "time_step_limit": _dt_limit(m),
           # the blocks behind the layers: which mixers have no MLP (read back by model.init_from)
           "megassm_pattern": "".join(kinds)}
    a = attn_dims(m)
    cfg.update(num_attention_heads=a["n_heads"], num_key_value_heads=a["n_kv_heads"], head_dim=a["head_dim"],
               attention_multiplier=a["head_dim"] ** -0.5, attention_bias=m.attn.bias,
               position_embedding_type="rope" if m.attn.rope else "nope")
    if m.attn.rope:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": float(m.attn.rope_theta)}
    if max_positions:
        cfg["max_position_embeddings"] = int(max_positions)
    return cfg


def hf_config(m: ModelConfig, target: str, vocab_padded: int, max_positions: int | None = None) -> dict:
    """The transformers config (keyword arguments of Mamba2Config / NemotronHConfig / GraniteMoeHybridConfig) of
    model config `m`. `max_positions`: GraniteMoeHybrid's max_position_embeddings (the trained length), which
    computes nothing here but is what vLLM takes as the default longest sequence."""
    if target == "granitemoehybrid":
        return _granite_config(m, vocab_padded, max_positions)
    common = {"vocab_size": vocab_padded, "hidden_size": m.d_model, "layer_norm_epsilon": m.norm_eps,
              "residual_in_fp32": True, "initializer_range": m.init_std}
    kinds = blocks_of(m.pattern)
    if target == "mamba2":
        return {**common, **_mamba_config(m), "state_size": m.mamba.d_state, "num_hidden_layers": len(kinds),
                "hidden_act": "silu", "tie_word_embeddings": m.tie_embeddings}
    cfg = {**common, **_mamba_config(m, "mamba_"), "ssm_state_size": m.mamba.d_state, "mamba_hidden_act": "silu",
           "mamba_proj_bias": m.mamba.proj_bias, "layers_block_type": [_NEMOTRON_TYPES[k] for k in kinds],
           # Nemotron-H declares no tied weights: a tied model is written with lm_head = a copy of the embedding
           "tie_word_embeddings": False}
    if "*" in kinds:
        a = attn_dims(m)
        cfg.update(num_attention_heads=a["n_heads"], num_key_value_heads=a["n_kv_heads"], head_dim=a["head_dim"],
                   attention_bias=False, sliding_window=None)
    if "-" in kinds:
        cfg.update(intermediate_size=ffn_hidden(m), mlp_hidden_act="relu2", mlp_bias=m.mlp.bias)
    return cfg


def _block_rename(kind: str, target: str) -> dict:
    """megassm mixer parameter suffix -> target suffix."""
    if kind == "-" and target == "nemotron_h":
        return {"w1": "up_proj", "w2": "down_proj"}
    return {}


def _to_granite(state: dict, m: ModelConfig) -> dict:
    """GraniteMoeHybrid names: layer j = the j-th mixer (input_layernorm, mamba / self_attn) and the `-` block
    right after it (post_attention_layernorm, shared_mlp with input_linear = [w1; w3], the gate rows first as its
    forward chunks them); a mixer with no `-` after it gets a unit norm and an all-zero MLP: output exactly 0."""
    kinds = blocks_of(m.pattern)
    out = {"model.embed_tokens.weight": state["embedding.weight"], "model.norm.weight": state["norm_f.weight"]}
    if "lm_head.weight" in state:
        out["lm_head.weight"] = state["lm_head.weight"]
    emb = state["embedding.weight"]
    ffn = ffn_hidden(m) if "-" in kinds else 0
    for j, (b, f) in enumerate(granite_layers(m.pattern)):
        pre, sub = f"model.layers.{j}.", "mamba" if kinds[b] == "M" else "self_attn"
        out[pre + "input_layernorm.weight"] = state[f"layers.{b}.norm.weight"]
        mix = f"layers.{b}.mixer."
        for name, t in state.items():
            if name.startswith(mix):
                rest = name[len(mix):]
                out[f"{pre}{sub}.{rest}"] = t.unsqueeze(1) if rest == "conv1d.weight" else t
        if f is not None:
            w = f"layers.{f}.mixer."
            out[pre + "post_attention_layernorm.weight"] = state[f"layers.{f}.norm.weight"]
            out[pre + "shared_mlp.input_linear.weight"] = torch.cat([state[w + "w1.weight"], state[w + "w3.weight"]])
            out[pre + "shared_mlp.output_linear.weight"] = state[w + "w2.weight"]
        else:
            out[pre + "post_attention_layernorm.weight"] = torch.ones(m.d_model, dtype=emb.dtype)
            out[pre + "shared_mlp.input_linear.weight"] = torch.zeros(2 * ffn, m.d_model, dtype=emb.dtype)
            out[pre + "shared_mlp.output_linear.weight"] = torch.zeros(m.d_model, ffn, dtype=emb.dtype)
    return out


def to_hf(state: dict, m: ModelConfig, target: str, vocab_padded: int,
          max_positions: int | None = None) -> tuple[dict, dict]:
    """(config kwargs, state dict with the target's names) of a canonical megassm model state."""
    if target == "granitemoehybrid":
        return hf_config(m, target, vocab_padded, max_positions), _to_granite(state, m)
    root = "backbone" if target == "mamba2" else "model"
    out = {f"{root}.embeddings.weight": state["embedding.weight"], f"{root}.norm_f.weight": state["norm_f.weight"]}
    if "lm_head.weight" in state:
        out["lm_head.weight"] = state["lm_head.weight"]
    elif target == "nemotron_h":
        out["lm_head.weight"] = state["embedding.weight"].clone()
    kinds = blocks_of(m.pattern)
    for i, k in enumerate(kinds):
        rename = _block_rename(k, target)
        pre = f"layers.{i}."
        for name, t in state.items():
            if not name.startswith(pre):
                continue
            rest = name[len(pre):]
            if rest.startswith("mixer."):
                mod, _, leaf = rest[len("mixer."):].partition(".")
                rest = "mixer." + ".".join(x for x in (rename.get(mod, mod), leaf) if x)
                if k == "M" and rest == "mixer.conv1d.weight":
                    t = t.unsqueeze(1)  # nn.Conv1d's [channels, 1, width]
            out[f"{root}.layers.{i}.{rest}"] = t
    return hf_config(m, target, vocab_padded), out


# ----------------------------------------------------------------------------------------------------
# transformers -> megassm
# ----------------------------------------------------------------------------------------------------
def config_value(cfg: dict, key: str, default=None, where: str = "config.json"):
    if key in cfg:
        return cfg[key]
    if default is None:
        raise MappingError(f"{where}: no '{key}'")
    return default


def _num(v) -> float:
    """A JSON number; transformers writes non-finite floats as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def limit_pair(v) -> list[float] | None:
    if v is None:
        return None
    lo, hi = _num(v[0]), _num(v[1])
    return None if (lo == 0.0 and math.isinf(hi)) else [lo, hi]


def _ssm_dims(m: ModelConfig, heads: int, where: str, key: str) -> None:
    if heads * m.mamba.headdim != m.mamba.expand * m.d_model:
        raise MappingError(f"{where}: {key}={heads} x head_dim {m.mamba.headdim} is not expand {m.mamba.expand} x "
                           f"hidden_size {m.d_model}: megassm's Mamba-2 has d_inner = expand x d_model")


_GRANITE_LETTERS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*"}


def _granite_model_config(cfg: dict, where: str) -> ModelConfig:
    """ModelConfig of a GraniteMoeHybrid config.json; MappingError for what computes something megassm's blocks do
    not (experts, multipliers other than 1, an attention scale other than 1/sqrt(head_dim), scaled or partial
    RoPE). Missing keys take GraniteMoeHybridConfig's defaults."""
    m = ModelConfig()
    m.d_model = int(config_value(cfg, "hidden_size", where=where))
    m.vocab_size = int(config_value(cfg, "vocab_size", where=where))
    m.pad_vocab_multiple = 1
    m.norm_eps = float(cfg.get("rms_norm_eps", 1e-6))
    m.tie_embeddings = bool(cfg.get("tie_word_embeddings", False))
    if int(cfg.get("num_local_experts", 8)) > 0:
        raise MappingError(f"{where}: num_local_experts={cfg.get('num_local_experts', 8)}: megassm builds no MoE "
                           "layers (only dense GraniteMoeHybrid models, num_local_experts=0, import)")
    for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        if _num(cfg.get(key, 1.0)) != 1.0:
            raise MappingError(f"{where}: {key}={cfg[key]}: megassm's model has no such multiplier (it needs 1)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise MappingError(f"{where}: hidden_act={cfg['hidden_act']!r}; megassm's Mamba-2 and SwiGLU use silu")
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if not types:
        raise MappingError(f"{where}: no 'layer_types'")
    bad = next((i for i, t in enumerate(types) if t not in _GRANITE_LETTERS), None)
    if bad is not None:
        raise MappingError(f"{where}: layer {bad} is '{types[bad]}', which megassm has no block for")
    mixers = "".join(_GRANITE_LETTERS[t] for t in types)
    ffn = int(cfg.get("shared_intermediate_size", 1024))
    pattern = cfg.get("megassm_pattern")
    if pattern is None:  # not a megassm export: every layer is a mixer and its MLP (none at width 0)
        pattern = "".join(k + ("-" if ffn else "") for k in mixers)
    layers = granite_layers(pattern)
    if (isinstance(layers, int) or "".join(blocks_of(pattern)[b] for b, _ in layers) != mixers
            or (ffn > 0) != ("-" in pattern)):
        raise MappingError(f"{where}: megassm_pattern {pattern!r} does not fit layer_types {types} and "
                           f"shared_intermediate_size={ffn}")
    m.pattern = pattern
    mc = m.mamba
    mc.d_state = int(cfg.get("mamba_d_state", 256))
    mc.d_conv = int(cfg.get("mamba_d_conv", 4))
    mc.expand = int(cfg.get("mamba_expand", 2))
    mc.ngroups = int(cfg.get("mamba_n_groups", 1))
    mc.chunk_size = int(cfg.get("mamba_chunk_size", 256))
    mc.conv_bias = bool(cfg.get("mamba_conv_bias", True))
    mc.proj_bias = bool(cfg.get("mamba_proj_bias", False))
    mc.dt_limit = limit_pair(cfg.get("time_step_limit"))
    heads = int(cfg.get("mamba_n_heads", 128))
    head = cfg.get("mamba_d_head", "auto")
    mc.headdim = mc.expand * m.d_model // heads if head == "auto" else int(head)
    if "M" in mixers:
        _ssm_dims(m, heads, where, "mamba_n_heads")
    a = m.attn
    a.n_heads = int(cfg.get("num_attention_heads", 32))
    a.n_kv_heads = int(cfg.get("num_key_value_heads") or a.n_heads)
    a.head_dim = int(cfg.get("head_dim") or m.d_model // a.n_heads)
    a.bias = bool(cfg.get("attention_bias", False))
    scale = _num(cfg.get("attention_multiplier", 1.0))
    if "*" in mixers and not math.isclose(scale, a.head_dim ** -0.5, rel_tol=1e-9):
        raise MappingError(f"{where}: attention_multiplier={scale}: megassm's attention scales by 1/sqrt(head_dim) "
                           f"= {a.head_dim ** -0.5}")
    a.rope = cfg.get("position_embedding_type") == "rope"
    if a.rope:
        rp = dict(cfg.get("rope_parameters") or {})
        if rp.get("rope_type", "default") != "default" or float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
            raise MappingError(f"{where}: rope_parameters={rp}: megassm's RoPE is the default (unscaled) one over the "
                               "whole head")
        a.rope_theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    m.mlp.activation = "swiglu"
    m.mlp.bias = False
    if ffn:
        m.mlp.ffn_hidden = ffn
    return m


def hf_model_config(cfg: dict, where: str = "config.json") -> tuple[str, ModelConfig]:
    """(target, ModelConfig) of a transformers Mamba2 / Nemotron-H / GraniteMoeHybrid config.json."""
    mt = cfg.get("model_type")
    if mt == "granitemoehybrid":
        return mt, _granite_model_config(cfg, where)
    m = ModelConfig()
    m.d_model = int(config_value(cfg, "hidden_size", where=where))
    m.vocab_size = int(config_value(cfg, "vocab_size", where=where))
    m.pad_vocab_multiple = 1
    m.norm_eps = float(cfg.get("layer_norm_epsilon", 1e-5))
    m.tie_embeddings = bool(cfg.get("tie_word_embeddings", mt == "mamba2"))
    mc = m.mamba
    mc.expand = int(cfg.get("expand", 2))
    mc.ngroups = int(cfg.get("n_groups", 8))
    mc.d_conv = int(cfg.get("conv_kernel", 4))
    mc.conv_bias = bool(cfg.get("use_conv_bias", True))
    mc.proj_bias = bool(cfg.get("use_bias", False))
    mc.dt_limit = limit_pair(cfg.get("time_step_limit"))
    mc.chunk_size = int(cfg.get("chunk_size", 256))
    if mt == "mamba2":
        if cfg.get("hidden_act", "silu") != "silu":
            raise MappingError(f"{where}: hidden_act={cfg['hidden_act']!r}; megassm's Mamba-2 uses silu")
        mc.d_state = int(cfg.get("state_size", 128))
        mc.headdim = int(cfg.get("head_dim", 64))
        _ssm_dims(m, int(config_value(cfg, "num_heads", where=where)), where, "num_heads")
        m.pattern = "M" * int(config_value(cfg, "num_hidden_layers", where=where))
        return "mamba2", m
    if mt != "nemotron_h":
        raise MappingError(f"{where}: model_type {mt!r} is not one megassm imports (mamba2, nemotron_h, "
                           "granitemoehybrid)")
    types = cfg.get("layers_block_type")
    if types is None and "hybrid_override_pattern" in cfg:
        types = list(cfg["hybrid_override_pattern"])
    if not types:
        raise MappingError(f"{where}: no 'layers_block_type' (or 'hybrid_override_pattern')")
    letters = {"mamba": "M", "linear_attention": "M", "M": "M", "attention": "*", "full_attention": "*", "*": "*",
               "mlp": "-", "-": "-"}
    bad = next((i for i, t in enumerate(types) if t not in letters), None)
    if bad is not None:
        raise MappingError(f"{where}: layer {bad} is '{types[bad]}', which megassm has no block for (MoE layers are "
                           "not built)")
    m.pattern = "".join(letters[t] for t in types)
    if cfg.get("mamba_hidden_act", "silu") != "silu":
        raise MappingError(f"{where}: mamba_hidden_act={cfg['mamba_hidden_act']!r}; megassm's Mamba-2 uses silu")
    mc.d_state = int(cfg.get("ssm_state_size", 128))
    mc.headdim = int(cfg.get("mamba_head_dim", 64))
    if "M" in m.pattern:
        _ssm_dims(m, int(config_value(cfg, "mamba_num_heads", where=where)), where, "mamba_num_heads")
    m.attn.rope = False
    m.attn.n_heads = int(cfg.get("num_attention_heads", 32))
    m.attn.n_kv_heads = int(cfg.get("num_key_value_heads") or m.attn.n_heads)
    m.attn.head_dim = int(cfg.get("head_dim", 128))
    if cfg.get("sliding_window"):
        raise MappingError(f"{where}: sliding_window={cfg['sliding_window']}: not a Nemotron-H layout megassm maps")
    m.mlp.activation = "relu2"
    if cfg.get("mlp_hidden_act", "relu2") != "relu2":
        raise MappingError(f"{where}: mlp_hidden_act={cfg['mlp_hidden_act']!r}; megassm's MLP is swiglu or relu2")
    m.mlp.ffn_hidden = int(cfg.get("intermediate_size", 21504))
    m.mlp.bias = bool(cfg.get("mlp_bias", False))
    return "nemotron_h", m


def _from_granite(m: ModelConfig, state: dict, where: str) -> dict:
    """Canonical megassm state of GraniteMoeHybrid weights (the inverse of _to_granite). The MLP of a layer whose
    mixer has no `-` after it must be all zeros (it then adds exactly nothing)."""
    kinds, layers = blocks_of(m.pattern), granite_layers(m.pattern)
    out = {}
    for name, t in state.items():
        if name == "model.embed_tokens.weight":
            out["embedding.weight"] = t
        elif name == "model.norm.weight":
            out["norm_f.weight"] = t
        elif name == "lm_head.weight":
            out["lm_head.weight"] = t
        elif name.startswith("model.layers."):
            j, rest = name[len("model.layers."):].split(".", 1)
            if int(j) >= len(layers):
                raise MappingError(f"{where}: weight '{name}' is beyond the {len(layers)} layers of the config")
            b, f = layers[int(j)]
            sub, _, leaf = rest.partition(".")
            if rest == "input_layernorm.weight":
                out[f"layers.{b}.norm.weight"] = t
            elif sub == {"M": "mamba", "*": "self_attn"}[kinds[b]]:
                out[f"layers.{b}.mixer.{leaf}"] = t.squeeze(1) if leaf == "conv1d.weight" and t.dim() == 3 else t
            elif f is None and sub in ("post_attention_layernorm", "shared_mlp"):
                if sub == "shared_mlp" and t.count_nonzero():
                    raise MappingError(f"{where}: '{name}' is not zero, but megassm_pattern {m.pattern!r} has no MLP "
                                       f"after block {b}: importing would drop what it computes")
            elif rest == "post_attention_layernorm.weight":
                out[f"layers.{f}.norm.weight"] = t
            elif rest == "shared_mlp.input_linear.weight":
                out[f"layers.{f}.mixer.w1.weight"], out[f"layers.{f}.mixer.w3.weight"] = t.chunk(2, dim=0)
            elif rest == "shared_mlp.output_linear.weight":
                out[f"layers.{f}.mixer.w2.weight"] = t
            else:
                raise MappingError(f"{where}: weight '{name}' has no megassm counterpart")
        else:
            raise MappingError(f"{where}: weight '{name}' has no megassm counterpart")
    return out


def from_hf(cfg: dict, state: dict, where: str = "config.json") -> tuple[ModelConfig, dict]:
    """(ModelConfig, canonical megassm state) of a transformers Mamba2 / Nemotron-H / GraniteMoeHybrid directory's
    contents."""
    target, m = hf_model_config(cfg, where)
    if target == "granitemoehybrid":
        return m, untie(m, _from_granite(m, state, where))
    root = "backbone" if target == "mamba2" else "model"
    out = {}
    inverse = {}
    for k in blocks_of(m.pattern):
        inverse[k] = {v: key for key, v in _block_rename(k, target).items()}
    kinds = blocks_of(m.pattern)
    for name, t in state.items():
        if name in (f"{root}.embeddings.weight", f"{root}.embedding.weight"):
            out["embedding.weight"] = t
        elif name == f"{root}.norm_f.weight":
            out["norm_f.weight"] = t
        elif name == "lm_head.weight":
            out["lm_head.weight"] = t
        elif name.startswith(f"{root}.layers."):
            i, rest = name[len(f"{root}.layers."):].split(".", 1)
            k = kinds[int(i)] if int(i) < len(kinds) else None
            if k is None:
                raise MappingError(f"{where}: weight '{name}' is beyond the {len(kinds)} layers of the config")
            if rest.startswith("mixer."):
                mod, _, leaf = rest[len("mixer."):].partition(".")
                rest = "mixer." + ".".join(x for x in (inverse[k].get(mod, mod), leaf) if x)
                if k == "M" and rest == "mixer.conv1d.weight" and t.dim() == 3:
                    t = t.squeeze(1)
            out[f"layers.{i}.{rest}"] = t
        else:
            raise MappingError(f"{where}: weight '{name}' has no megassm counterpart")
    return m, untie(m, out)


def untie(m: ModelConfig, out: dict) -> dict:
    """A tied source keeps one matrix (drop a stored lm_head copy)."""
    if m.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


# ----------------------------------------------------------------------------------------------------
# comparing a source's model config with the run's
# ----------------------------------------------------------------------------------------------------
# keys that only shape the seeded init or the kernels' blocking, never what trained weights compute
_INIT_ONLY = {"init_from", "init_std", "vocab_size", "pad_vocab_multiple", "mamba.chunk_size", "mamba.dt_min",
              "mamba.dt_max", "mamba.dt_init_floor", "mamba.A_init_min", "mamba.A_init_max", "attn.doc_mask"}
_SECTIONS = {"mamba": "MB", "attn": "*B", "mlp": "-", "coffee": "C", "bmojo": "B", "mamba1": "S", "longhorn": "L"}


def _flat(m: ModelConfig) -> dict:
    out = {}
    for f in dataclasses.fields(m):
        v = getattr(m, f.name)
        if dataclasses.is_dataclass(v):
            out.update({f"{f.name}.{g.name}": getattr(v, g.name) for g in dataclasses.fields(v)})
        else:
            out[f.name] = v
    return out


def _section_used(key: str, letters: set) -> bool:
    sec = key.split(".", 1)[0]
    return sec not in _SECTIONS or bool(letters & set(_SECTIONS[sec]))


def _resolved(m: ModelConfig) -> dict:
    """The flat config with derived sizes filled in (unset n_kv_heads / head_dim / ffn_hidden)."""
    f = _flat(m)
    letters = set(blocks_of(m.pattern))
    if letters & {"*", "B"}:
        a = attn_dims(m)
        f["attn.n_kv_heads"], f["attn.head_dim"] = a["n_kv_heads"], a["head_dim"]
    if "-" in letters:
        f["mlp.ffn_hidden"] = ffn_hidden(m)
    return f


def config_differences(source: ModelConfig, run: ModelConfig, compared: set | None = None) -> list[tuple]:
    """(key, source value, run value) of every model key (of the sections the pattern uses) that changes what
    the weights compute. `compared`: only these keys (a foreign source sets only what its format says)."""
    src, now = _resolved(source), _resolved(run)
    letters = set(blocks_of(run.pattern)) | set(blocks_of(source.pattern))
    out = []
    for key in now:
        if key in _INIT_ONLY or not _section_used(key, letters) or (compared is not None and key not in compared):
            continue
        if key == "pattern":
            if blocks_of(src[key]) != blocks_of(now[key]):  # stage cuts (`|`) move no weights
                out.append((key, src[key], now[key]))
        elif key == "tie_embeddings":
            continue  # decided from the weights themselves (interop/sources.py)
        elif key == "attn.rope_theta" and not (src["attn.rope"] or now["attn.rope"]):
            continue  # no RoPE on either side: the base computes nothing
        elif src[key] != now[key]:
            out.append((key, src[key], now[key]))
    return out


FOREIGN_KEYS = {"pattern", "d_model", "norm_eps", "mamba.d_state", "mamba.d_conv", "mamba.expand", "mamba.headdim",
                "mamba.ngroups", "mamba.dt_limit", "mamba.conv_bias", "mamba.proj_bias", "mamba.D_has_hdim",
                "mamba.norm_before_gate", "attn.n_heads", "attn.n_kv_heads", "attn.head_dim", "attn.rope",
                "attn.rope_theta", "attn.sliding_window", "attn.bias", "mlp.ffn_hidden", "mlp.bias", "mlp.activation"}


def equal_tensors(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
