"""TEST-ONLY SHIM: megatron-core's MambaModel built and run on a CPU-only torch without Transformer Engine,
mamba_ssm or causal_conv1d, so the Megatron-LM bridge (megassm/interop/megatron.py) is checked against megatron-core's
own modules, sharded_state_dict, dist_checkpointing load / save and forward.

What is replaced, and why (nothing else of megatron-core is touched):
- MambaMixer's two mamba_ssm kernels, which are Triton/CUDA only and absent here: `mamba_chunk_scan_combined`
  (the SSD scan) and `RMSNormGated` (the grouped gated norm, as megatron's ExtendedRMSNorm). Their stand-ins below
  follow mamba_ssm's documented semantics (its ssd_combined interface and layernorm_gated.rms_norm_ref) and are
  written independently of megassm.kernels: the scan is a token-by-token fp64 recurrence, not a chunked SSD. The
  conv runs in megatron's own code (its nn.Conv1d path, taken when causal_conv1d is absent).
- `torch.cuda.current_device()`, which MambaMixer passes as `device=` for its conv / A_log / dt_bias / D / norm:
  "cpu". `torch.cuda.synchronize()` (megatron's checkpoint writer calls it after staging tensors): a no-op.
- MambaStack's final norm, built with Transformer Engine's TENorm unconditionally: megatron's own
  WrappedTorchNorm (torch.nn.RMSNorm), the norm of megatron's local specs.
- torch.compile of megatron's fused activations (its jit_fuser): off, the same functions run eagerly (a CPU compile
  costs ~15 s per test).
- The layer spec: megatron ships only Transformer Engine specs for MambaStack; `local_stack_spec` is the same stack
  with megatron's local modules (ColumnParallelLinear / RowParallelLinear / DotProductAttention / WrappedTorchNorm),
  their separate pre-norms mapped to the TE names by `sharded_state_dict_keys_map`, as megatron's GPT local spec does.
The RNG tracker is megatron's own inference tracker (no CUDA RNG states to fork).
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn


def reference_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                         cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
                         return_varlen_states=False):
    """mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined's result, token by token in fp64:
    x [b, l, h, p], dt [b, l, h], A [h], B / C [b, l, g, n] (head i reads group i // (h / g)), D [h] or [h, p],
    z [b, l, h, p] -> y [b, l, h, p] in x's dtype; h_t = exp(dt_t A) h_(t-1) + dt_t x_t B_t^T, y_t = C_t h_t + D x_t,
    y *= silu(z). chunk_size only tiles the kernel's work."""
    if initial_states is not None or seq_idx is not None or cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError("the test shim covers a forward without carried states or packed sequences")
    bsz, seqlen, nh, hd = x.shape
    ng = B.shape[2]
    xd, dtd, Bd, Cd = x.double(), dt.double(), B.double(), C.double()
    if dt_bias is not None:
        dtd = dtd + dt_bias.double()
    if dt_softplus:
        dtd = F.softplus(dtd)
    dtd = dtd.clamp(min=dt_limit[0], max=dt_limit[1])
    Bh = Bd.repeat_interleave(nh // ng, dim=2)  # [b, l, h, n]
    Ch = Cd.repeat_interleave(nh // ng, dim=2)
    state = torch.zeros(bsz, nh, hd, B.shape[-1], dtype=torch.float64)
    ys = []
    for t in range(seqlen):
        decay = torch.exp(dtd[:, t] * A.double())  # [b, h]
        state = decay[:, :, None, None] * state + (dtd[:, t, :, None] * xd[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        Dd = D.double()
        y = y + xd * (Dd[:, None] if Dd.dim() == 1 else Dd)
    if z is not None:
        y = y * F.silu(z.double())
    y = y.to(x.dtype)
    return (y, state.to(x.dtype)) if return_final_states else y


class ReferenceGatedRMSNorm(nn.Module):
    """mamba_ssm.ops.triton.layernorm_gated.RMSNorm (megatron's ExtendedRMSNorm base): groups of `group_size`
    contiguous channels, x * silu(z) before the norm unless norm_before_gate, weight per channel; computed in fp64.
    sharded_state_dict as megatron's ExtendedRMSNorm: the weight TP-sharded on axis 0."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size or hidden_size, norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x, z=None):
        xd = x.double()
        if z is not None and not self.norm_before_gate:
            xd = xd * F.silu(z.double())
        g = xd.reshape(*xd.shape[:-1], -1, self.group_size)
        out = (g * torch.rsqrt(g.square().mean(-1, keepdim=True) + self.eps)).reshape(xd.shape) * self.weight.double()
        if z is not None and self.norm_before_gate:
            out = out * F.silu(z.double())
        return out.to(x.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"])


@contextlib.contextmanager
def cpu_shim():
    """The replacements listed in the module docstring, undone on exit."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|Torch Norm).*")
        from megatron.core.ssm import mamba_block, mamba_mixer
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
    saved = [(torch.cuda, "current_device", torch.cuda.current_device),
             (torch.cuda, "synchronize", torch.cuda.synchronize),
             (mamba_mixer, "HAVE_MAMBA_SSM", mamba_mixer.HAVE_MAMBA_SSM),
             (mamba_mixer, "ExtendedRMSNorm", mamba_mixer.ExtendedRMSNorm),
             (mamba_mixer, "mamba_chunk_scan_combined", getattr(mamba_mixer, "mamba_chunk_scan_combined", None)),
             (mamba_block, "TENorm", mamba_block.TENorm)]
    saved.append((torch._dynamo.config, "disable", torch._dynamo.config.disable))
    torch._dynamo.config.disable = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer.ExtendedRMSNorm = ReferenceGatedRMSNorm
    mamba_mixer.mamba_chunk_scan_combined = reference_chunk_scan
    mamba_block.TENorm = WrappedTorchNorm
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def local_stack_spec(d_conv: int = 4, D_has_hdim: bool = False):
    """MambaStack with megatron-core's local (non-Transformer-Engine) modules; the pre-norms' sharded names are the
    TE spec's (`...in_proj.layer_norm_weight` etc.), so checkpoints are interchangeable with TE-trained ones."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=WrappedTorchNorm,
        mixer=ModuleSpec(module=MambaMixer, params={"d_conv": d_conv, "D_has_hdim": D_has_hdim},
                         submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add, sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"}))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                                     core_attention=DotProductAttention,
                                                                     linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add, sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(mamba_layer=mamba, attention_layer=attention,
                                                                       mlp_layer=mlp))


# the local spec's state-dict names of the blocks' pre-norms -> the TE spec's (the legacy format's names)
_LOCAL_TO_TE = {"norm.weight": "mixer.in_proj.layer_norm_weight",
                "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def te_name(local: str) -> str:
    """`decoder.layers.3.norm.weight` -> `decoder.layers.3.mixer.in_proj.layer_norm_weight` (other names unchanged)."""
    parts = local.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["decoder", "layers"] and parts[3] in _LOCAL_TO_TE:
        return ".".join(parts[:3] + [_LOCAL_TO_TE[parts[3]]])
    return local


def init_megatron(tp: int) -> None:
    """megatron's parallel_state over the already initialized torch.distributed group (tp ranks, nothing else),
    and its RNG tracker without CUDA states."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def build_from_args(args, tp: int = 1):
    """megatron-core's MambaModel of the Megatron-LM arguments a converted checkpoint records (as
    pretrain_mamba.py builds it from them), fp32, on the CPU, under cpu_shim()."""
    from megatron.core.activations import squared_relu
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        mamba_state_dim=args.mamba_state_dim, mamba_head_dim=args.mamba_head_dim,
        mamba_num_groups=args.mamba_num_groups, mamba_num_heads=args.mamba_num_heads,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p, gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else squared_relu, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, tensor_model_parallel_size=tp, params_dtype=torch.float32,
        use_cpu_initialization=True, use_mamba_mem_eff_path=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, persist_layer_norm=False, masked_softmax_fusion=False)
    return MambaModel(config=cfg, mamba_stack_spec=local_stack_spec(args.megassm_mamba_d_conv,
                                                                    args.megassm_mamba_D_has_hdim),
                      vocab_size=args.padded_vocab_size, max_sequence_length=4096,
                      hybrid_override_pattern=args.hybrid_override_pattern,
                      position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                      rotary_percent=args.rotary_percent, parallel_output=False,
                      share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[B, L, vocab] logits of megatron's forward (eval mode), with the causal mask Megatron-LM's data path passes."""
    model.eval()
    L = tokens.shape[1]
    position_ids = torch.arange(L).expand_as(tokens)
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    return model(tokens, position_ids, mask)
