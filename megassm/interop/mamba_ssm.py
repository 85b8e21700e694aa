"""megassm <-> mamba_ssm's Mamba-2 checkpoints (state-spaces/mamba2-*: MambaLMHeadModel's config.json +
pytorch_model.bin): the config and the parameter names, both ways. Pure functions over dicts, as mapping.py.

    model_cfg, state = from_mamba_ssm(ssm_config, ssm_state)
    ssm_config, ssm_state = to_mamba_ssm(state, model_cfg, vocab)
"""
from __future__ import annotations

from megassm.config import ModelConfig, blocks_of

from .mapping import MappingError, NotExportable, config_value, limit_pair, untie

_INF = float("inf")

__all__ = ["mamba_ssm_model_config", "from_mamba_ssm", "to_mamba_ssm"]


_SSM_DEFAULTS = {"d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64, "ngroups": 1, "chunk_size": 256,
                 "D_has_hdim": False, "rmsnorm": True, "norm_before_gate": False, "bias": False, "conv_bias": True,
                 "dt_limit": (0.0, _INF), "d_ssm": None}


def mamba_ssm_model_config(cfg: dict, where: str = "config.json") -> ModelConfig:
    """ModelConfig of a mamba_ssm MambaLMHeadModel config.json (Mamba-2 layers only)."""
    ssm = dict(cfg.get("ssm_cfg") or {})
    layer = ssm.pop("layer", "Mamba1")
    if layer != "Mamba2":
        raise MappingError(f"{where}: ssm_cfg.layer is '{layer}' (mamba_ssm's default is Mamba1); megassm imports "
                           "Mamba-2 checkpoints (ssm_cfg.layer = Mamba2)")
    if cfg.get("attn_layer_idx"):
        raise MappingError(f"{where}: attn_layer_idx={cfg['attn_layer_idx']}: mamba_ssm's attention layers (packed "
                           "qkv, partial rotary) are not mapped; only Mamba-2 layers are")
    if cfg.get("d_intermediate", 0):
        raise MappingError(f"{where}: d_intermediate={cfg['d_intermediate']}: mamba_ssm's in-block MLPs are not "
                           "mapped; only Mamba-2 layers are")
    if not cfg.get("rms_norm", True):
        raise MappingError(f"{where}: rms_norm=false (LayerNorm blocks); megassm uses RMSNorm")
    unknown = sorted(set(ssm) - set(_SSM_DEFAULTS) - {"dt_min", "dt_max", "dt_init_floor", "A_init_range",
                                                       "conv_init", "use_mem_eff_path"})
    if unknown:
        raise MappingError(f"{where}: ssm_cfg.{unknown[0]} is not a Mamba-2 option megassm maps")
    o = {**_SSM_DEFAULTS, **ssm}
    for key, ok in (("rmsnorm", True), ("d_ssm", None)):
        if o[key] != ok and not (key == "d_ssm" and o[key] == o["expand"] * cfg.get("d_model", 0)):
            raise MappingError(f"{where}: ssm_cfg.{key}={o[key]!r} has no megassm counterpart (needs {ok!r})")
    m = ModelConfig()
    m.d_model = int(config_value(cfg, "d_model", where=where))
    m.pattern = "M" * int(config_value(cfg, "n_layer", where=where))
    mult = int(cfg.get("pad_vocab_size_multiple", 8))
    m.vocab_size = int(config_value(cfg, "vocab_size", where=where))
    m.pad_vocab_multiple = mult
    m.tie_embeddings = bool(cfg.get("tie_embeddings", True))
    m.norm_eps = float(cfg.get("norm_epsilon", 1e-5))
    mc = m.mamba
    mc.d_state, mc.d_conv, mc.expand = int(o["d_state"]), int(o["d_conv"]), int(o["expand"])
    mc.headdim, mc.ngroups, mc.chunk_size = int(o["headdim"]), int(o["ngroups"]), int(o["chunk_size"])
    mc.D_has_hdim, mc.norm_before_gate = bool(o["D_has_hdim"]), bool(o["norm_before_gate"])
    mc.proj_bias, mc.conv_bias = bool(o["bias"]), bool(o["conv_bias"])
    mc.dt_limit = limit_pair(o["dt_limit"])
    return m


def from_mamba_ssm(cfg: dict, state: dict, where: str = "config.json") -> tuple[ModelConfig, dict]:
    """(ModelConfig, canonical megassm state) of a mamba_ssm Mamba-2 checkpoint."""
    m = mamba_ssm_model_config(cfg, where)
    out = {}
    for name, t in state.items():
        if name == "backbone.embedding.weight":
            out["embedding.weight"] = t
        elif name == "backbone.norm_f.weight":
            out["norm_f.weight"] = t
        elif name == "lm_head.weight":
            out["lm_head.weight"] = t
        elif name.startswith("backbone.layers."):
            i, rest = name[len("backbone.layers."):].split(".", 1)
            if rest == "mixer.conv1d.weight" and t.dim() == 3:
                t = t.squeeze(1)
            elif rest == "mixer.D" and m.mamba.D_has_hdim and t.dim() == 1:
                t = t.view(-1, m.mamba.headdim)  # mamba_ssm keeps per-channel D flat [d_inner]
            out[f"layers.{i}.{rest}"] = t
        else:
            raise MappingError(f"{where}: weight '{name}' has no megassm counterpart")
    return m, untie(m, out)


def to_mamba_ssm(state: dict, m: ModelConfig, vocab: int) -> tuple[dict, dict]:
    """(config.json, state dict) in mamba_ssm's layout (Mamba-2 patterns only); used to build test fixtures."""
    if set(blocks_of(m.pattern)) != {"M"}:
        raise NotExportable("mamba_ssm layout: only patterns of `M` blocks map to MambaLMHeadModel")
    out = {"backbone.embedding.weight": state["embedding.weight"], "backbone.norm_f.weight": state["norm_f.weight"],
           "lm_head.weight": state.get("lm_head.weight", state["embedding.weight"])}
    for name, t in state.items():
        if name.startswith("layers."):
            if name.endswith("mixer.conv1d.weight"):
                t = t.unsqueeze(1)
            out["backbone." + name] = t
    mc = m.mamba
    ssm_cfg = {"layer": "Mamba2", "d_state": mc.d_state, "d_conv": mc.d_conv, "expand": mc.expand,
               "headdim": mc.headdim, "ngroups": mc.ngroups, "chunk_size": mc.chunk_size, "bias": mc.proj_bias,
               "conv_bias": mc.conv_bias}
    if mc.dt_limit is not None:
        ssm_cfg["dt_limit"] = list(mc.dt_limit)
    cfg = {"d_model": m.d_model, "d_intermediate": 0, "n_layer": len(m.pattern), "vocab_size": vocab,
           "ssm_cfg": ssm_cfg, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
           "fused_add_norm": True, "pad_vocab_size_multiple": m.pad_vocab_multiple,
           "tie_embeddings": m.tie_embeddings}
    return cfg, out
