"""Megatron-LM bridge: megassm canonical weights <-> megatron-core `MambaModel` checkpoints (the hybrid `M` / `*` /
`-` model of Megatron-LM's pretrain_mamba.py and NeMo's Nemotron-H recipes).

    check_expressible(model_cfg, tp)                 # MegatronError, one line naming every reason, or None
    tensors = to_megatron(state, model_cfg)          # megassm names -> the torch_dist keys, global (TP-agnostic) shapes
    state = from_megatron(tensors, model_cfg)        # and back; the tensors are carried bit for bit
    args = megatron_args(model_cfg, vocab_padded, tp) / model_config_from_args(args, tensors)
    write_megatron(out_dir, tensors, args, m, fmt, tp)   # OUT/latest_checkpointed_iteration.txt + OUT/release/...
    state, model_cfg, facts = read_megatron(path)    # either format, any TP degree it was saved at, -> canonical

Formats. `torch_dist` is Megatron's distributed checkpoint (megatron.core.dist_checkpointing over
torch.distributed.checkpoint): one tensor per ShardedTensor key at its global shape, so it is TP- (and PP-)
agnostic by design and Megatron reshards it on load at any degree. The keys are the standard (Transformer Engine)
spec's: the pre-norm of each block fused into its first projection (`in_proj.layer_norm_weight`,
`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`), which megatron's local specs map their separate
norms to (`sharded_state_dict_keys_map`), and the Mamba mixer's in_proj / conv1d stored per component
(`in_proj.weight.z|x|B|C|dt`, `conv1d.weight.x|B|C`) as MambaMixer.sharded_state_dict splits them. `legacy` is the
per-TP-rank `mp_rank_XX/model_optim_rng.pt` of Megatron-LM's `--ckpt-format torch`: each rank's own slices of the
module state dict under the TE spec's names, with the `<module>._extra_state` entries its linears keep (None).

Both are written as Megatron-LM's converted-weights layout, `release/` named by the tracker file, which
Megatron-LM loads without optimizer or RNG state; `args` in common.pt / model_optim_rng.pt carry the model
arguments (`--use-checkpoint-args` reads them). Only weights are converted: optimizer states are not carried either
way. The writer uses megatron-core's own dist_checkpointing.save (its key translation, save planner, common.pt and
metadata.json) with the files written by torch.distributed.checkpoint's FileSystemWriter: megatron's own writer
calls torch.cuda.synchronize() and so cannot run without CUDA.

megatron-core is imported lazily (only the file I/O needs it; the name mapping is plain torch). docs/interop.md
"Megatron-LM".
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import logging
import os
import tempfile
import warnings

import torch

from megassm.config import ModelConfig, attn_dims, blocks_of, ffn_hidden, mamba_dims

__all__ = ["MegatronError", "FORMATS", "require_megatron_core", "check_expressible", "to_megatron", "from_megatron",
           "megatron_args", "model_config_from_args", "shard_rank", "merge_ranks", "write_megatron", "read_megatron",
           "is_megatron_checkpoint"]

log = logging.getLogger(__name__)

FORMATS = ("torch_dist", "legacy")
TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
LEGACY_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version (QKV interleaved per query group)
# MambaMixer builds its gated RMSNorm with eps=1e-5 whatever the config's layernorm_epsilon
MIXER_NORM_EPS = 1e-5
_WHERE = 'docs/interop.md "Megatron-LM"'


class MegatronError(ValueError):
    """Not expressible in megatron-core's MambaModel, not a readable Megatron checkpoint, or megatron-core missing
    (the message names the block / key / file and why, on one line)."""


def _megatron():
    """megatron.core's dist_checkpointing, imported on first use (its import warns about Transformer Engine and
    Apex, which a checkpoint conversion does not use)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
            from megatron.core import dist_checkpointing
    except ImportError as e:
        raise MegatronError(f"Megatron-LM checkpoints need megatron-core ({e}): pip install megatron-core") from e
    return dist_checkpointing


def require_megatron_core() -> None:
    """MegatronError naming `pip install megatron-core` when it does not import (checked before any file is read)."""
    _megatron()


# ----------------------------------------------------------------------------------------------------
# what MambaModel can express
# ----------------------------------------------------------------------------------------------------
def check_expressible(m: ModelConfig, tp: int = 1, vocab_padded: int | None = None) -> None:
    """None when megatron-core's MambaModel (Megatron-LM's hybrid arguments) computes what `m` computes and loads
    it at tensor-parallel degree `tp`; else MegatronError, one line naming every reason (its first block by index and
    letter) so that one retraining or one choice of --tp is enough."""
    kinds = blocks_of(m.pattern)
    found: dict[str, list] = {}  # reason -> [letter, block indices]

    def refuse(i: int, k: str, why: str) -> None:
        found.setdefault(why, [k, []])[1].append(i)

    mc, a = m.mamba, m.attn
    has = set(kinds)
    for i, k in enumerate(kinds):
        if k not in ("M", "*", "-"):
            refuse(i, k, "MambaModel's layers are M (Mamba-2), * (attention), - (MLP) and E (MoE): no counterpart")
        elif k == "M":
            if mc.proj_bias:
                refuse(i, k, "model.mamba.proj_bias=true, where MambaMixer's in_proj / out_proj have no bias")
            if mc.norm_before_gate:
                refuse(i, k, "model.mamba.norm_before_gate=true, where MambaMixer gates before its norm")
            if mc.dt_limit is not None:
                refuse(i, k, f"model.mamba.dt_limit={list(mc.dt_limit)}, where MambaMixer does not clamp dt")
            if not mc.conv_bias:
                refuse(i, k, "model.mamba.conv_bias=false, where MambaMixer's conv1d has a bias")
            if m.norm_eps != MIXER_NORM_EPS:
                refuse(i, k, f"model.norm_eps={m.norm_eps}, where MambaMixer's gated norm uses eps {MIXER_NORM_EPS}")
        elif k == "*":
            if a.sliding_window:
                refuse(i, k, f"model.attn.sliding_window={a.sliding_window} is not mapped (Megatron's window_size "
                             "attention is not verified by this bridge)")
    # Megatron's add_bias_linear adds biases to every attention and MLP linear at once
    biases = {("attn", a.bias) for k in has if k == "*"} | {("mlp", m.mlp.bias) for k in has if k == "-"}
    if len({b for _, b in biases}) > 1:
        i = next(i for i, k in enumerate(kinds) if k in "*-")
        refuse(i, kinds[i], f"model.attn.bias={a.bias} and model.mlp.bias={m.mlp.bias}, where Megatron's "
                            "add_bias_linear gives biases to attention and MLP linears together")
    splits = []  # what --tp must divide (megatron-core asserts each at build time)
    if tp > 1:
        divisible = []
        if "M" in has:
            d = mamba_dims(m)
            divisible += [("the Mamba-2 heads", d["nheads"]),
                          ("model.mamba.ngroups, which MambaMixer splits and never replicates", mc.ngroups)]
        if "*" in has:
            ad = attn_dims(m)
            divisible += [("model.attn.n_heads", ad["n_heads"]), ("the K/V heads (num_query_groups)", ad["n_kv_heads"])]
        if "-" in has:
            divisible.append(("model.mlp.ffn_hidden", ffn_hidden(m)))
        if vocab_padded is not None:
            divisible.append(("the padded vocabulary", vocab_padded))
        splits = [f"{what} ({n})" for what, n in divisible if n % tp]
    if not found and not splits:
        return
    parts = []
    for why, (k, where) in found.items():
        more = f" (and {len(where) - 1} more block{'s' if len(where) > 2 else ''})" if len(where) > 1 else ""
        parts.append(f"block {where[0]} '{k}': {why}{more}")
    head = []
    if parts:
        head.append(f"model.pattern {m.pattern!r} has no exact megatron-core MambaModel counterpart: "
                    f"{'; '.join(parts)}")
    if splits:
        head.append(f"--tp {tp} must divide {', '.join(splits)}")
    raise MegatronError(f"{'; '.join(head)}; {_WHERE}")


# ----------------------------------------------------------------------------------------------------
# names and layouts (pure torch)
# ----------------------------------------------------------------------------------------------------
def _mamba_sizes(m: ModelConfig) -> tuple[list[int], list[int]]:
    """(in_proj rows [z, x, B, C, dt], conv channels [x, B, C]) of one Mamba-2 mixer."""
    d = mamba_dims(m)
    gn = m.mamba.ngroups * m.mamba.d_state
    return [d["d_inner"], d["d_inner"], gn, gn, d["nheads"]], [d["d_inner"], gn, gn]


_IN_PROJ = ("z", "x", "B", "C", "dt")
_CONV = ("x", "B", "C")
_NORM_KEY = {"M": "mixer.in_proj.layer_norm_weight", "*": "self_attention.linear_qkv.layer_norm_weight",
             "-": "mlp.linear_fc1.layer_norm_weight"}


def _qkv_interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Megatron's linear_qkv rows: per query group g, its query heads, then K head g, then V head g (so a TP rank
    holding whole groups holds a contiguous block)."""
    rest = q.shape[1:]
    return torch.cat([q.reshape(n_kv, -1, *rest), k.reshape(n_kv, -1, *rest), v.reshape(n_kv, -1, *rest)],
                     dim=1).reshape(-1, *rest)


def _qkv_split(qkv: torch.Tensor, n_kv: int, q_rows: int, kv_rows: int):
    rest = qkv.shape[1:]
    g = qkv.reshape(n_kv, -1, *rest)
    per_q = q_rows // n_kv
    per_kv = kv_rows // n_kv
    q, k, v = torch.split(g, [per_q, per_kv, per_kv], dim=1)
    return q.reshape(q_rows, *rest), k.reshape(kv_rows, *rest), v.reshape(kv_rows, *rest)


def to_megatron(state: dict, m: ModelConfig) -> dict[str, torch.Tensor]:
    """megassm's canonical state dict -> {torch_dist key: tensor at its global shape}. Values are not changed."""
    kinds = blocks_of(m.pattern)
    in_sizes, conv_sizes = _mamba_sizes(m)
    out = {"embedding.word_embeddings.weight": state["embedding.weight"]}
    for i, k in enumerate(kinds):
        p, q = f"layers.{i}.", f"decoder.layers.{i}."
        out[q + _NORM_KEY[k]] = state[p + "norm.weight"]
        if k == "M":
            x = p + "mixer."
            for name, t in zip(_IN_PROJ, torch.split(state[x + "in_proj.weight"], in_sizes)):
                out[f"{q}mixer.in_proj.weight.{name}"] = t
            for name, t in zip(_CONV, torch.split(state[x + "conv1d.weight"], conv_sizes)):
                out[f"{q}mixer.conv1d.weight.{name}"] = t.unsqueeze(1)  # nn.Conv1d's [C, 1, W]
            for name, t in zip(_CONV, torch.split(state[x + "conv1d.bias"], conv_sizes)):
                out[f"{q}mixer.conv1d.bias.{name}"] = t
            out[q + "mixer.A_log"] = state[x + "A_log"]
            out[q + "mixer.dt_bias"] = state[x + "dt_bias"]
            out[q + "mixer.D"] = state[x + "D"].reshape(-1)  # D_has_hdim: [H, P] -> Megatron's [d_inner]
            out[q + "mixer.norm.weight"] = state[x + "norm.weight"]
            out[q + "mixer.out_proj.weight"] = state[x + "out_proj.weight"]
        elif k == "*":
            x, n_kv = p + "mixer.", attn_dims(m)["n_kv_heads"]
            for suffix in ("weight", "bias"):
                if x + f"q_proj.{suffix}" in state:
                    out[f"{q}self_attention.linear_qkv.{suffix}"] = _qkv_interleave(
                        state[x + f"q_proj.{suffix}"], state[x + f"k_proj.{suffix}"], state[x + f"v_proj.{suffix}"],
                        n_kv)
                if x + f"o_proj.{suffix}" in state:
                    out[f"{q}self_attention.linear_proj.{suffix}"] = state[x + f"o_proj.{suffix}"]
        else:
            x = p + "mixer."
            for suffix in ("weight", "bias"):
                if x + f"w1.{suffix}" in state:
                    # SwiGLU: Megatron's fc1 is [gate | up], activation on the first half: our w1 (gate), w3 (up)
                    parts = [state[x + f"w1.{suffix}"]] + ([state[x + f"w3.{suffix}"]] if x + f"w3.{suffix}" in state
                                                           else [])
                    out[f"{q}mlp.linear_fc1.{suffix}"] = torch.cat(parts) if len(parts) > 1 else parts[0]
                if x + f"w2.{suffix}" in state:
                    out[f"{q}mlp.linear_fc2.{suffix}"] = state[x + f"w2.{suffix}"]
    out["decoder.final_norm.weight"] = state["norm_f.weight"]
    if "lm_head.weight" in state:
        out["output_layer.weight"] = state["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def from_megatron(tensors: dict, m: ModelConfig, zero_centered_gamma: bool = False) -> dict[str, torch.Tensor]:
    """{torch_dist key: tensor} -> megassm's canonical state dict for `m` (fp32). `zero_centered_gamma`
    (Megatron-LM's --apply-layernorm-1p): the stored pre-norm / final-norm weights are w - 1."""
    kinds = blocks_of(m.pattern)
    in_sizes, conv_sizes = _mamba_sizes(m)
    used: set[str] = set()

    def get(key: str) -> torch.Tensor:
        if key not in tensors:
            raise MegatronError(f"the Megatron checkpoint has no tensor '{key}', which model.pattern {m.pattern!r} "
                                f"(block kinds {''.join(kinds)}) needs; {_WHERE}")
        used.add(key)
        return tensors[key].float()

    def norm(key: str) -> torch.Tensor:
        return get(key) + 1.0 if zero_centered_gamma else get(key)

    state = {"embedding.weight": get("embedding.word_embeddings.weight")}
    for i, k in enumerate(kinds):
        p, q = f"layers.{i}.", f"decoder.layers.{i}."
        state[p + "norm.weight"] = norm(q + _NORM_KEY[k])
        x = p + "mixer."
        if k == "M":
            state[x + "in_proj.weight"] = torch.cat([get(f"{q}mixer.in_proj.weight.{n}") for n in _IN_PROJ])
            state[x + "conv1d.weight"] = torch.cat([get(f"{q}mixer.conv1d.weight.{n}").squeeze(1) for n in _CONV])
            state[x + "conv1d.bias"] = torch.cat([get(f"{q}mixer.conv1d.bias.{n}") for n in _CONV])
            state[x + "A_log"] = get(q + "mixer.A_log")
            state[x + "dt_bias"] = get(q + "mixer.dt_bias")
            D = get(q + "mixer.D")
            state[x + "D"] = D.reshape(mamba_dims(m)["nheads"], m.mamba.headdim) if m.mamba.D_has_hdim else D
            state[x + "norm.weight"] = get(q + "mixer.norm.weight")
            state[x + "out_proj.weight"] = get(q + "mixer.out_proj.weight")
        elif k == "*":
            ad = attn_dims(m)
            q_rows, kv_rows = ad["n_heads"] * ad["head_dim"], ad["n_kv_heads"] * ad["head_dim"]
            for suffix in ("weight", "bias") if m.attn.bias else ("weight",):
                qs, ks, vs = _qkv_split(get(f"{q}self_attention.linear_qkv.{suffix}"), ad["n_kv_heads"], q_rows,
                                        kv_rows)
                state[x + f"q_proj.{suffix}"], state[x + f"k_proj.{suffix}"], state[x + f"v_proj.{suffix}"] = qs, ks, vs
                state[x + f"o_proj.{suffix}"] = get(f"{q}self_attention.linear_proj.{suffix}")
        else:
            for suffix in ("weight", "bias") if m.mlp.bias else ("weight",):
                fc1 = get(f"{q}mlp.linear_fc1.{suffix}")
                if m.mlp.activation == "swiglu":
                    state[x + f"w1.{suffix}"], state[x + f"w3.{suffix}"] = torch.chunk(fc1, 2)
                else:
                    state[x + f"w1.{suffix}"] = fc1
                state[x + f"w2.{suffix}"] = get(f"{q}mlp.linear_fc2.{suffix}")
    state["norm_f.weight"] = norm("decoder.final_norm.weight")
    if not m.tie_embeddings:
        state["lm_head.weight"] = get("output_layer.weight")
    left = sorted(set(tensors) - used)
    if left:
        raise MegatronError(f"the Megatron checkpoint has {len(left)} tensor(s) model.pattern {m.pattern!r} does not "
                            f"use, first '{left[0]}' (a layer kind or option megassm lacks, e.g. MoE); {_WHERE}")
    return {k: v.contiguous() for k, v in state.items()}


# ----------------------------------------------------------------------------------------------------
# Megatron-LM's arguments
# ----------------------------------------------------------------------------------------------------
def megatron_args(m: ModelConfig, vocab_padded: int, tp: int = 1, dtype: torch.dtype = torch.float32,
                  fmt: str = "torch_dist") -> argparse.Namespace:
    """The Megatron-LM arguments (pretrain_mamba.py's names) of `m`, as common.pt / model_optim_rng.pt record them."""
    d = mamba_dims(m)
    ad = attn_dims(m)
    kinds = blocks_of(m.pattern)
    bias = (m.attn.bias and "*" in kinds) or (m.mlp.bias and "-" in kinds)
    return argparse.Namespace(
        num_layers=len(kinds), hidden_size=m.d_model, hybrid_override_pattern="".join(kinds),
        hybrid_attention_ratio=0.0, hybrid_mlp_ratio=0.0,
        ffn_hidden_size=ffn_hidden(m), num_attention_heads=ad["n_heads"], kv_channels=ad["head_dim"],
        group_query_attention=ad["n_kv_heads"] != ad["n_heads"], num_query_groups=ad["n_kv_heads"],
        mamba_state_dim=m.mamba.d_state, mamba_head_dim=m.mamba.headdim, mamba_num_groups=m.mamba.ngroups,
        mamba_num_heads=d["nheads"], normalization="RMSNorm", norm_epsilon=m.norm_eps, apply_layernorm_1p=False,
        position_embedding_type="rope" if m.attn.rope else "none", add_position_embedding=False,
        rotary_base=m.attn.rope_theta, rotary_percent=1.0, rotary_interleaved=False,
        swiglu=m.mlp.activation == "swiglu", squared_relu=m.mlp.activation == "relu2",
        add_bias_linear=bool(bias), add_qkv_bias=bool(bias),
        untie_embeddings_and_output_weights=not m.tie_embeddings, padded_vocab_size=vocab_padded,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, ckpt_format=fmt,
        use_dist_ckpt=fmt == "torch_dist", no_save_optim=True, no_save_rng=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # not Megatron-LM arguments: what MambaMixer takes from its spec's params (defaults d_conv 4, D per head)
        megassm_mamba_d_conv=m.mamba.d_conv, megassm_mamba_D_has_hdim=m.mamba.D_has_hdim,
    )


def _arg(args, name: str, default=None):
    return getattr(args, name, default)


def model_config_from_args(args, shapes: dict) -> tuple[ModelConfig, bool]:
    """(the megassm model config, zero_centered_gamma) of a Megatron checkpoint's `args` and its tensors' global
    `shapes` ({torch_dist key: shape}; they give what the arguments leave to MambaMixer's spec: d_conv, D per head or
    per channel, and the padded vocabulary)."""
    def refuse(why: str):
        raise MegatronError(f"the Megatron checkpoint's arguments: {why}; {_WHERE}")

    pattern = _arg(args, "hybrid_override_pattern")
    if not pattern:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
            from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers
        pattern = "".join(allocate_layers(args.num_layers, _arg(args, "hybrid_attention_ratio", 0.0) or 0.0,
                                          _arg(args, "hybrid_mlp_ratio", 0.0) or 0.0, None))
    pattern = "".join(c for c in pattern if c not in "|")
    if set(pattern) - set("M*-"):
        lacks = "".join(sorted(set(pattern) - set("M*-")))
        refuse(f"hybrid_override_pattern {pattern!r} has layers megassm lacks ({lacks}; E is MoE)")
    if _arg(args, "normalization", "LayerNorm") != "RMSNorm":
        refuse(f"normalization={_arg(args, 'normalization', 'LayerNorm')}, megassm's norms are RMSNorm")
    d_model = int(args.hidden_size)
    m = ModelConfig(pattern=pattern, d_model=d_model, vocab_size=None, tie_embeddings=not _arg(
        args, "untie_embeddings_and_output_weights", False), norm_eps=float(_arg(args, "norm_epsilon", 1e-5)))
    rows = shapes["embedding.word_embeddings.weight"][0]
    m.vocab_size = rows
    m.pad_vocab_multiple = 128 if rows % 128 == 0 else 1  # the rows are already Megatron's padded vocabulary
    if "M" in pattern:
        headdim = int(_arg(args, "mamba_head_dim", 64))
        nheads = _arg(args, "mamba_num_heads") or (2 * d_model) // headdim
        d_inner = int(nheads) * headdim
        if d_inner % d_model:
            refuse(f"the Mamba-2 inner width {d_inner} (mamba_num_heads x mamba_head_dim) is not a multiple of "
                   f"hidden_size {d_model} (megassm's model.mamba.expand is an integer)")
        i = pattern.index("M")
        conv = shapes.get(f"decoder.layers.{i}.mixer.conv1d.weight.x")
        D = shapes.get(f"decoder.layers.{i}.mixer.D")
        m.mamba = dataclasses.replace(
            m.mamba, d_state=int(_arg(args, "mamba_state_dim", 128)), headdim=headdim, expand=d_inner // d_model,
            ngroups=int(_arg(args, "mamba_num_groups", 8)), d_conv=int(conv[-1]) if conv is not None else 4,
            D_has_hdim=D is not None and D[0] == d_inner and d_inner != int(nheads))
    if "*" in pattern:
        pe = _arg(args, "position_embedding_type", "learned_absolute")
        if pe not in ("rope", "none"):
            refuse(f"position_embedding_type={pe}, megassm's attention has RoPE or nothing")
        if pe == "rope" and (float(_arg(args, "rotary_percent", 1.0)) != 1.0 or _arg(args, "rotary_interleaved")):
            refuse("partial or interleaved RoPE (rotary_percent / rotary_interleaved), megassm rotates whole heads, "
                   "half-split")
        if _arg(args, "window_size") is not None:
            refuse(f"window_size={args.window_size} is not mapped")
        heads = int(args.num_attention_heads)
        kv = int(_arg(args, "num_query_groups") or heads) if _arg(args, "group_query_attention") else heads
        m.attn = dataclasses.replace(m.attn, n_heads=heads, n_kv_heads=kv,
                                     head_dim=int(_arg(args, "kv_channels") or d_model // heads),
                                     rope=pe == "rope", rope_theta=float(_arg(args, "rotary_base", 10000)),
                                     bias=bool(_arg(args, "add_bias_linear", True)), sliding_window=0)
        if _arg(args, "add_qkv_bias") and not m.attn.bias:
            refuse("add_qkv_bias without add_bias_linear (Q/K/V biases without an output-projection bias)")
    if "-" in pattern:
        if _arg(args, "swiglu"):
            act = "swiglu"
        elif _arg(args, "squared_relu"):
            act = "relu2"
        else:
            refuse("the MLP activation is neither SwiGLU (--swiglu) nor squared ReLU (--squared-relu)")
        m.mlp = dataclasses.replace(m.mlp, ffn_hidden=int(args.ffn_hidden_size), activation=act,
                                    bias=bool(_arg(args, "add_bias_linear", True)))
    return m, bool(_arg(args, "apply_layernorm_1p", False))


# ----------------------------------------------------------------------------------------------------
# tensor parallelism of the legacy format
# ----------------------------------------------------------------------------------------------------
def _kind_of_key(key: str, m: ModelConfig) -> tuple[str | None, str]:
    """(block letter or None, the key without 'decoder.layers.i.')."""
    if key.startswith("decoder.layers."):
        i, rest = key[len("decoder.layers."):].split(".", 1)
        kinds = blocks_of(m.pattern)
        # a layer past the pattern's is kept as it is and refused by name later (_check_shapes)
        return (kinds[int(i)] if i.isdigit() and int(i) < len(kinds) else None), rest
    return None, key


def _legacy_key(key: str) -> str:
    """The module state-dict name of a torch_dist key (in_proj / conv1d components are one tensor there)."""
    for base in ("mixer.in_proj.weight.", "mixer.conv1d.weight.", "mixer.conv1d.bias."):
        if base in key:
            return key[: key.index(base) + len(base) - 1]
    return key


# linears whose Transformer Engine / megatron modules keep an `_extra_state` entry in their state dict
_EXTRA = {"M": ("mixer.in_proj", "mixer.out_proj"),
          "*": ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj"),
          "-": ("mlp.linear_fc1", "mlp.linear_fc2")}


def _extra_state_keys(m: ModelConfig) -> list[str]:
    """The output layer's too: it exists without a weight when the embedding is tied."""
    keys = [f"decoder.layers.{i}.{mod}._extra_state" for i, k in enumerate(blocks_of(m.pattern)) for mod in _EXTRA[k]]
    return keys + ["output_layer._extra_state"]


def shard_rank(tensors: dict, m: ModelConfig, tp: int, rank: int) -> dict:
    """TP rank `rank`'s module state dict (Megatron-LM's --ckpt-format torch) of the global `tensors`: column-parallel
    rows and row-parallel columns sliced as megatron's layers hold them, the rest replicated."""
    out: dict = {}
    for key, t in tensors.items():
        _, rest = _kind_of_key(key, m)
        name = _legacy_key(key)
        if rest.startswith(("mixer.in_proj.weight.", "mixer.conv1d.")) or rest in (
                "mixer.A_log", "mixer.dt_bias", "mixer.D", "mixer.norm.weight", "self_attention.linear_qkv.weight",
                "self_attention.linear_qkv.bias") or key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            piece = torch.chunk(t, tp, dim=0)[rank]
        elif rest in ("mixer.out_proj.weight", "self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
            piece = torch.chunk(t, tp, dim=1)[rank]
        elif rest in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
            halves = torch.chunk(t, 2) if m.mlp.activation == "swiglu" else (t,)
            piece = torch.cat([torch.chunk(h, tp)[rank] for h in halves])  # each rank: [gate_r | up_r]
        else:  # norms, row-parallel biases: replicated
            piece = t
        out[name] = torch.cat([out[name], piece]) if name in out else piece  # in_proj / conv1d: component order
    for k in _extra_state_keys(m):
        out[k] = None
    return {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def merge_ranks(ranks: list[dict], m: ModelConfig, where: str) -> dict:
    """The inverse of shard_rank: the TP ranks' module state dicts -> {torch_dist key: global tensor}."""
    tp = len(ranks)
    in_sizes, conv_sizes = _mamba_sizes(m)
    out = {}

    def pieces(name: str) -> list[torch.Tensor]:
        missing = [r for r, sd in enumerate(ranks) if name not in sd]
        if missing:
            raise MegatronError(f"{where}: mp_rank_{missing[0]:02d} has no tensor '{name}'; {_WHERE}")
        return [sd[name] for sd in ranks]

    names = [k for k, v in ranks[0].items() if isinstance(v, torch.Tensor)]
    for name in names:
        _, rest = _kind_of_key(name, m)
        got = pieces(name)
        if rest in ("mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias"):
            sizes, comps = (in_sizes, _IN_PROJ) if rest == "mixer.in_proj.weight" else (conv_sizes, _CONV)
            local = [torch.split(g, [s // tp for s in sizes]) for g in got]
            for c, comp in enumerate(comps):
                out[f"{name}.{comp}"] = torch.cat([parts[c] for parts in local])
        elif rest in ("mixer.A_log", "mixer.dt_bias", "mixer.D", "mixer.norm.weight",
                      "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias") or name in (
                "embedding.word_embeddings.weight", "output_layer.weight"):
            out[name] = torch.cat(got)
        elif rest in ("mixer.out_proj.weight", "self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
            out[name] = torch.cat(got, dim=1)
        elif rest in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
            halves = [torch.chunk(g, 2) if m.mlp.activation == "swiglu" else (g,) for g in got]
            out[name] = torch.cat([torch.cat([h[j] for h in halves]) for j in range(len(halves[0]))])
        else:
            for r, g in enumerate(got[1:], 1):
                if not torch.equal(g, got[0]):
                    raise MegatronError(f"{where}: '{name}' is replicated over tensor-parallel ranks but differs "
                                        f"between mp_rank_00 and mp_rank_{r:02d}")
            out[name] = got[0]
    return out


# ----------------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _process_group():
    """A one-process gloo group for dist_checkpointing (which asks torch.distributed for ranks and barriers); the
    caller's own group when there is one."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise MegatronError("Megatron checkpoint conversion runs in one process (torch.distributed is initialized "
                                f"with {dist.get_world_size()} ranks)")
        yield
        return
    with tempfile.TemporaryDirectory(prefix="megassm-megatron-") as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _sync_strategy():
    """megatron-core's torch_dist save strategy with torch.distributed.checkpoint's synchronous FileSystemWriter in
    place of megatron's async writer (whose preload calls torch.cuda.synchronize()): the same translation of the
    ShardedTensors, the same planner, the same files (`__0_0.distcp`, `.metadata`)."""
    from megatron.core.dist_checkpointing.strategies import torch as mtorch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    used = ("TorchDistSaveShardedStrategy", "_replace_state_dict_keys_with_sharded_keys", "mcore_to_pyt_state_dict",
            "MCoreSavePlanner")
    lacking = [n for n in used if not hasattr(mtorch, n)]
    if lacking:  # internals of megatron-core's torch_dist strategy (as of 0.16.1)
        from megatron.core import __version__

        raise MegatronError(f"megatron-core {__version__}: its torch_dist strategy has no {', '.join(lacking)} (this "
                            "converter was written against megatron-core 0.16.1)")

    class _SyncTorchDistSave(mtorch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            sd, _, _ = mtorch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                         self.keep_only_main_replica)
            dcp_save(mtorch.mcore_to_pyt_state_dict(sd, False), storage_writer=FileSystemWriter(str(checkpoint_dir)),
                     planner=mtorch.MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                                     flatten_state_dict=False))

    return _SyncTorchDistSave("torch_dist", 1)


def write_megatron(out_dir: str, tensors: dict, args: argparse.Namespace, m: ModelConfig, fmt: str = "torch_dist",
                   tp: int = 1, dtype: torch.dtype = torch.float32) -> list[str]:
    """Write `tensors` (torch_dist keys, global) into the empty directory `out_dir` as Megatron-LM's release
    checkpoint: out_dir/latest_checkpointed_iteration.txt ("release") and out_dir/release/ with the torch_dist files,
    or mp_rank_XX/model_optim_rng.pt for each of `tp` ranks. Returns the files written (relative paths)."""
    if fmt not in FORMATS:
        raise MegatronError(f"Megatron checkpoint format must be one of {', '.join(FORMATS)}, got '{fmt}'")
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    rel = os.path.join(out_dir, RELEASE)
    os.makedirs(rel)
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}
    if fmt == "torch_dist":
        dc = _megatron()
        from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

        with _process_group():
            # one process holds every tensor whole (replica 0 of a one-piece sharding): the global layout Megatron
            # reshards to its own TP / PP degrees on load
            sharded = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}
            # the linears' `_extra_state` objects (one per layer whatever the TP degree), which megatron's load
            # requires by default: None, what megatron's local linears hold (Transformer Engine's: FP8 metadata)
            for k in _extra_state_keys(m):
                sharded[k] = ShardedObject(k, None, (1,), (0,), replica_id=0)
            dc.save({**common, "model": sharded}, rel, sharded_strategy=_sync_strategy())
    else:
        for r in range(tp):
            d = os.path.join(rel, f"mp_rank_{r:02d}")
            os.makedirs(d)
            torch.save({**common, "model": shard_rank(tensors, m, tp, r)}, os.path.join(d, LEGACY_FILE))
    with open(os.path.join(out_dir, TRACKER), "w") as f:
        f.write(RELEASE)
    return sorted(os.path.relpath(p, out_dir) for p in glob.glob(os.path.join(out_dir, "**"), recursive=True)
                  + glob.glob(os.path.join(rel, ".*")) if os.path.isfile(p))


def _iteration_dir(path: str) -> str:
    """The directory holding one checkpoint: `path` itself, or the one its tracker file names."""
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        name = RELEASE if text == RELEASE else f"iter_{int(text):07d}" if text.isdigit() else None
        if name is None:
            raise MegatronError(f"{tracker}: neither 'release' nor an iteration number: {text[:40]!r}")
        sub = os.path.join(path, name)
        if not os.path.isdir(sub):
            raise MegatronError(f"{tracker} names {name}, which {path} does not have")
        return sub
    return path


def is_megatron_checkpoint(path: str) -> bool:
    """A Megatron-LM checkpoint directory (its tracker file) or one iteration of one (torch_dist or legacy)."""
    if os.path.isfile(os.path.join(path, TRACKER)):
        return True
    return os.path.isfile(os.path.join(path, "metadata.json")) and os.path.isfile(os.path.join(path, "common.pt")) \
        or bool(glob.glob(os.path.join(path, "mp_rank_*", LEGACY_FILE)))


def _torch_load_trusted(path: str):
    """Megatron-LM pickles its arguments (argparse.Namespace, torch dtypes, enums): not loadable with
    weights_only=True. Only for files the user names as a checkpoint to convert."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a damaged or foreign file
        raise MegatronError(f"{path}: not readable as a Megatron checkpoint file: {type(e).__name__}: {e}") from e


def expected_shapes(m: ModelConfig, vocab_padded: int) -> dict[str, tuple]:
    """{torch_dist key: global shape} of model config `m` (from a shape-only model, mapped by to_megatron)."""
    from megassm.models import build_model

    rows = dataclasses.replace(m, vocab_size=vocab_padded, pad_vocab_multiple=1)  # the embedding's rows as given
    meta = build_model(rows, device="meta").state_dict()
    return {k: tuple(v.shape) for k, v in to_megatron(meta, m).items()}


def _check_shapes(where: str, expected: dict, found: dict) -> None:
    """MegatronError naming the first tensor missing, unexpected or of another shape than `m` gives."""
    for k, shape in expected.items():
        if k not in found:
            raise MegatronError(f"{where}: the checkpoint has no tensor '{k}', which the model config needs; {_WHERE}")
        if tuple(found[k]) != shape:
            raise MegatronError(f"{where}: '{k}' is {list(found[k])} in the checkpoint, {list(shape)} for the model "
                                f"config; {_WHERE}")
    extra = [k for k in found if k not in expected]
    if extra:
        raise MegatronError(f"{where}: the checkpoint has {len(extra)} tensor(s) the model config has no place for, "
                            f"first '{extra[0]}' (a layer kind or option megassm lacks, e.g. MoE); {_WHERE}")


def read_megatron(path: str, model_cfg: ModelConfig | None = None) -> tuple[dict, ModelConfig, dict]:
    """(megassm's canonical state dict (fp32), its model config, facts) of the Megatron checkpoint at `path` (its
    directory with the tracker file, or one iteration directory), either format, at whatever TP degree it was saved.
    The model config comes from the checkpoint's arguments and shapes, or is `model_cfg` (checked against the
    shapes). torch_dist: only the model's tensors are read; an optimizer's stay on disk. facts: format, tp, args,
    the stored dtype, the directory read."""
    it = _iteration_dir(path)
    if os.path.isfile(os.path.join(it, "metadata.json")):
        dc = _megatron()
        with _process_group(), warnings.catch_warnings():
            # megatron's loader calls torch's deprecated load_state_dict (a FutureWarning per load)
            warnings.filterwarnings("ignore", category=FutureWarning)
            try:
                common = dc.load_common_state_dict(it)
                meta = dc.load_tensors_metadata(it)
            except Exception as e:  # noqa: BLE001 - megatron raises its own CheckpointingException and others
                raise MegatronError(f"{it}: not readable as a Megatron distributed checkpoint: "
                                    f"{type(e).__name__}: {e}") from e
            args = common.get("args") if isinstance(common, dict) else None
            # model tensors only: a distributed optimizer's state sits under 'optimizer.' in the same files
            shapes = {k: tuple(v.global_shape) for k, v in meta.items() if not k.startswith("optimizer.")}
            m, zc = _config(it, args, shapes, model_cfg)
            _check_shapes(it, expected_shapes(m, shapes["embedding.word_embeddings.weight"][0]), shapes)
            loaded = dc.load({k: meta[k] for k in shapes}, it, validate_access_integrity=False)
        tensors = {k: loaded[k] for k in shapes}
        fmt, tp = "torch_dist", int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    else:
        files = sorted(glob.glob(os.path.join(it, "mp_rank_*", LEGACY_FILE)))
        if not files:
            raise MegatronError(f"{path}: not a Megatron checkpoint (no {TRACKER}, metadata.json or "
                                f"mp_rank_XX/{LEGACY_FILE})")
        staged = [os.path.basename(os.path.dirname(f)) for f in files]
        staged = [s for s in staged if s.count("_") > 2]
        if staged:
            raise MegatronError(f"{it}: {staged[0]}: pipeline-parallel legacy checkpoints are not read; save it "
                                "with --ckpt-format torch_dist (any PP degree)")
        ranks = [_torch_load_trusted(f) for f in files]
        bad = [f for f, r in zip(files, ranks) if not isinstance(r, dict) or not isinstance(r.get("model"), dict)]
        if bad:
            raise MegatronError(f"{bad[0]}: no 'model' state dict inside")
        args, states, tp = ranks[0].get("args"), [r["model"] for r in ranks], len(ranks)
        # the global shapes the arguments leave open: rows summed over the ranks, conv width and D's size
        s0 = {k: tuple(v.shape) for k, v in states[0].items() if isinstance(v, torch.Tensor)}
        hints = {"embedding.word_embeddings.weight": (s0["embedding.word_embeddings.weight"][0] * tp,)}
        for k, v in s0.items():
            if k.endswith("mixer.conv1d.weight"):
                hints[k + ".x"] = v
            elif k.endswith("mixer.D"):
                hints[k] = (v[0] * tp,)
        m, zc = _config(it, args, hints, model_cfg)
        tensors = merge_ranks(states, m, it)
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        _check_shapes(it, expected_shapes(m, shapes["embedding.word_embeddings.weight"][0]), shapes)
        fmt = "legacy"
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in tensors.values()})
    state = from_megatron(tensors, m, zero_centered_gamma=zc)
    return state, m, {"format": fmt, "tp": tp, "args": args, "dtype": ",".join(dtypes), "dir": it}


def _config(where: str, args, shapes: dict, model_cfg: ModelConfig | None) -> tuple[ModelConfig, bool]:
    zc = bool(getattr(args, "apply_layernorm_1p", False)) if args is not None else False
    if model_cfg is not None:
        return model_cfg, zc
    if args is None:
        raise MegatronError(f"{where}: the checkpoint records no Megatron-LM arguments ('args'): pass --config with "
                            "the model's megassm config")
    return model_config_from_args(args, shapes)
