"""Mamba-2 mixer (`M`), written to the contract in design.md.

    zxbcdt = in_proj(u)                    d_model -> [z | x | B | C | dt] = [d_inner, d_inner, G*N, G*N, H]
    xBC    = silu(causal_conv1d(x|B|C))    depthwise, width d_conv, conv_dim = d_inner + 2*G*N channels
    y      = SSD(x, dt, A, B, C, D)        A = -exp(A_log) per head, dt = softplus(dt + dt_bias) (clamped
                                           to dt_limit if set), D skip per head (or per channel)
    y      = gated_rmsnorm(y, z)           norm_g(y * silu(z)) * w, G groups (or norm before the gate)
    out    = out_proj(y)                   d_inner -> d_model

All the math runs in megassm.kernels (ssd, causal_conv1d, gated_rmsnorm and their one-token steps), so the
Triton kernels replace the references without touching this file.

Tensor-parallel layout (declared by `mamba2_tp_layout` below, applied from outside by parallel/tp.py):
`in_proj.weight` rows are the concatenation of the five components listed in `in_proj_sizes`,
`conv1d.weight`/`bias` rows are [x | B | C] (`conv_sizes`); a TP plan slices each component separately
(heads and groups divide by TP) and keeps the canonical layout in checkpoints. A_log, dt_bias, D and the norm weight are per head/group and shard with the heads.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megassm import kernels
from megassm.config import ModelConfig, mamba_dims

from .init import InitRule, make_linear
from .norm import GatedRMSNorm
from .registry import BlockKind, Cut, Replicate, Split, TPLayout, register, ssd_flops
from .state import MambaState

__all__ = ["Mamba2Mixer", "CausalConv1d"]


def to_fp32(t: torch.Tensor) -> torch.Tensor:
    """States are fp32 (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class CausalConv1d(nn.Module):
    """Parameters of the depthwise causal conv: weight [channels, width] (weight[:, -1] multiplies the
    current token), bias [channels]. Init like torch's Conv1d default: U(+-1/sqrt(fan_in)), fan_in = width."""

    def __init__(self, channels: int, width: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, width, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(channels, dtype=torch.float32)) if bias else None
        bound = 1.0 / math.sqrt(width)
        self.init_rules = {
            "weight": InitRule("uniform", low=-bound, high=bound),
            "bias": InitRule("uniform", low=-bound, high=bound, no_wd=True),
        }

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, width={self.weight.shape[1]}, bias={self.bias is not None}"


class Mamba2Mixer(nn.Module):
    stateful = True  # carries a recurrent state (models/state.py)
    norm_spans_ranks = False  # a TP variant sets it: the grouped norm's statistics are summed over the TP ranks

    def __init__(self, cfg: ModelConfig, n_layer: int):
        super().__init__()
        mc = cfg.mamba
        dims = mamba_dims(cfg)
        self.d_model = cfg.d_model
        self.d_inner = dims["d_inner"]
        self.nheads = dims["nheads"]
        self.headdim = mc.headdim
        self.ngroups = mc.ngroups
        self.d_state = mc.d_state
        self.d_conv = mc.d_conv
        self.chunk_size = mc.chunk_size
        self.dt_limit = tuple(mc.dt_limit) if mc.dt_limit is not None else None
        if self.d_inner % self.headdim or self.nheads % self.ngroups:
            raise ValueError(
                f"Mamba-2: headdim {self.headdim} must divide d_inner {self.d_inner} and ngroups {self.ngroups} "
                f"must divide the heads {self.nheads}"
            )
        gn = self.ngroups * self.d_state
        self.conv_dim = self.d_inner + 2 * gn
        self.in_proj_sizes = [self.d_inner, self.d_inner, gn, gn, self.nheads]  # z, x, B, C, dt
        self.conv_sizes = [self.d_inner, gn, gn]  # x, B, C

        std = cfg.init_std
        self.in_proj = make_linear(cfg.d_model, sum(self.in_proj_sizes), mc.proj_bias, std)
        self.conv1d = CausalConv1d(self.conv_dim, mc.d_conv, bias=mc.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.nheads, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.nheads, dtype=torch.float32))
        d_shape = (self.nheads, self.headdim) if mc.D_has_hdim else (self.nheads,)
        self.D = nn.Parameter(torch.empty(d_shape, dtype=torch.float32))
        self.norm = GatedRMSNorm(self.d_inner, self.ngroups, cfg.norm_eps, mc.norm_before_gate)
        self.out_proj = make_linear(self.d_inner, cfg.d_model, mc.proj_bias, std / math.sqrt(2 * n_layer))
        self.init_rules = {
            "dt_bias": InitRule("dt_bias", low=mc.dt_min, high=mc.dt_max, floor=mc.dt_init_floor, no_wd=True),
            "A_log": InitRule("A_log", low=mc.A_init_min, high=mc.A_init_max, no_wd=True),
            "D": InitRule("ones", no_wd=True),
        }

    def norm_out_proj(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """out_proj(gated_rmsnorm(y, z)). One method so that a tensor-parallel plan whose norm groups span
        ranks (TP > ngroups) can sum the norm statistics over them (parallel/tp.py)."""
        return self.out_proj(self.norm(y, z))

    # ------------------------------------------------------------------------------------------------
    def allocate_state(self, batch_size: int, device=None) -> MambaState:
        return MambaState(
            conv=torch.zeros(batch_size, self.conv_dim, self.d_conv - 1, device=device, dtype=torch.float32),
            ssm=torch.zeros(
                batch_size, self.nheads, self.headdim, self.d_state, device=device, dtype=torch.float32
            ),
        )

    def _A(self) -> torch.Tensor:
        # at least fp32 (fp64 stays fp64, so the oracle tests can compare tightly)
        return -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))

    def forward(
        self,
        u: torch.Tensor,
        seq_idx: torch.Tensor | None = None,
        state: MambaState | None = None,
        return_state: bool = False,
    ) -> tuple[torch.Tensor, MambaState | None]:
        """u [B, L, d_model]; seq_idx [B, L] int32 document ids; state: carried into the first document of
        each row. Returns (out [B, L, d_model], final state or None)."""
        zxbcdt = self.in_proj(u)
        # the rows' length from the projection: under TP + SP with parallel.tp_overlap, in_proj all-gathers the
        # sequence shards itself (parallel/layers.py ColumnParallelLinear)
        bsz, seqlen, _ = zxbcdt.shape
        # the gated norm, the conv and the SSD write dz, dxBC, ddt as the blocks of one buffer: no cat backward
        z, xBC, dt = kernels.split_last(zxbcdt, [self.d_inner, self.conv_dim, self.nheads], share_grads=True)
        xBC, conv_state = self.conv(xBC, seq_idx, None if state is None else state.conv, return_state)
        x, B, C = kernels.split_last(xBC, self.conv_sizes)  # no cat in the backward (the SSD writes dxBC whole)
        y, ssm_state = self.scan(
            x.reshape(bsz, seqlen, self.nheads, self.headdim),
            dt,
            B.reshape(bsz, seqlen, self.ngroups, self.d_state),
            C.reshape(bsz, seqlen, self.ngroups, self.d_state),
            seq_idx,
            None if state is None else state.ssm,
            return_state,
        )
        out = self.norm_out_proj(y.reshape(bsz, seqlen, self.d_inner), z)
        new_state = MambaState(conv=to_fp32(conv_state), ssm=to_fp32(ssm_state)) if return_state else None
        return out, new_state

    # conv and scan are methods so that a plan applied from outside can override them (parallel/cp.py)
    def conv(self, xBC, seq_idx, conv_state, return_state):
        """silu(causal_conv1d(xBC)) [B, L, conv_dim] and, if asked, the final conv state (else None)."""
        out = kernels.causal_conv1d(
            xBC,
            self.conv1d.weight,
            self.conv1d.bias,
            initial_state=conv_state,
            seq_idx=seq_idx,
            activation="silu",
            return_final_state=return_state,
        )
        return out if return_state else (out, None)

    def scan(self, x, dt, B, C, seq_idx, ssm_state, return_state):
        """SSD with the D skip (the gate is applied later, in the grouped norm): x [B, L, H, P], dt [B, L, H],
        B/C [B, L, G, N]. Returns (y [B, L, H, P], final state [B, H, P, N] fp32 or None)."""
        out = kernels.ssd(
            x,
            dt,
            self._A(),
            B,
            C,
            D=self.D,
            z=None,
            dt_bias=self.dt_bias,
            dt_softplus=True,
            dt_limit=self.dt_limit,
            initial_states=ssm_state,
            seq_idx=seq_idx,
            chunk_size=self.chunk_size,
            return_final_states=return_state,
        )
        return out if return_state else (out, None)

    def step(self, u: torch.Tensor, state: MambaState) -> tuple[torch.Tensor, MambaState]:
        """One token: u [B, d_model] -> (out [B, d_model], new state). Resets are applied by the caller."""
        bsz = u.shape[0]
        zxbcdt = self.in_proj(u)
        z, xBC, dt = torch.split(zxbcdt, [self.d_inner, self.conv_dim, self.nheads], dim=-1)
        xBC, conv_state = kernels.causal_conv1d_step(
            state.conv, xBC, self.conv1d.weight, self.conv1d.bias, activation="silu"
        )
        x, B, C = torch.split(xBC, self.conv_sizes, dim=-1)
        y, ssm_state = kernels.ssd_step(
            state.ssm,
            x.reshape(bsz, self.nheads, self.headdim),
            dt,
            self._A(),
            B.reshape(bsz, self.ngroups, self.d_state),
            C.reshape(bsz, self.ngroups, self.d_state),
            D=self.D,
            z=None,
            dt_bias=self.dt_bias,
            dt_softplus=True,
            dt_limit=self.dt_limit,
        )
        out = self.norm_out_proj(y.reshape(bsz, self.d_inner), z)
        return out, MambaState(conv=to_fp32(conv_state), ssm=to_fp32(ssm_state))


# ----------------------------------------------------------------------------------------------------
# the block kind `M`
# ----------------------------------------------------------------------------------------------------
def check_mamba_section(cfg, need) -> None:
    """model.mamba.* (read by `M` and by B'MOJO's SSM)."""
    m, p = cfg.model, cfg.parallel
    mb = m.mamba
    d_inner = mb.expand * m.d_model
    need(d_inner % mb.headdim == 0,
         f"model.mamba.headdim={mb.headdim} must divide d_inner = model.mamba.expand x model.d_model = {d_inner}")
    nheads = d_inner // mb.headdim
    need(mb.ngroups >= 1 and nheads % mb.ngroups == 0,
         f"model.mamba.ngroups={mb.ngroups} must divide the number of heads {nheads} (d_inner {d_inner} / headdim {mb.headdim})")
    need(2 <= mb.d_conv <= 4, f"model.mamba.d_conv must be 2..4, got {mb.d_conv}")
    need(mb.chunk_size > 0, f"model.mamba.chunk_size must be positive, got {mb.chunk_size}")
    need(0 < mb.dt_min <= mb.dt_max,
         f"model.mamba.dt_min must be in (0, model.mamba.dt_max], got {mb.dt_min} and {mb.dt_max}")
    need(0 < mb.A_init_min <= mb.A_init_max,
         f"model.mamba.A_init_min must be in (0, model.mamba.A_init_max], got {mb.A_init_min} and {mb.A_init_max}")
    if mb.dt_limit is not None:
        need(len(mb.dt_limit) == 2 and mb.dt_limit[0] < mb.dt_limit[1],
             f"model.mamba.dt_limit must be [lo, hi] with lo < hi, got {mb.dt_limit}")
    need(nheads % p.tp == 0, f"parallel.tp={p.tp} must divide the Mamba-2 heads ({nheads})")
    need(mb.ngroups % p.tp == 0 or p.tp % mb.ngroups == 0,
         f"parallel.tp={p.tp} and model.mamba.ngroups={mb.ngroups}: one must divide the other "
         "(groups split across TP ranks, or B/C replicated when tp > ngroups)")


def _check_layout(cfg, need) -> None:
    m, t, p = cfg.model, cfg.train, cfg.parallel
    need(p.cp == 1 or t.seq_len // p.cp >= m.mamba.d_conv - 1,
         f"parallel.cp={p.cp}: train.seq_len / parallel.cp = {t.seq_len // p.cp} tokens per rank is shorter than "
         f"the Mamba-2 conv halo (model.mamba.d_conv - 1 = {m.mamba.d_conv - 1})")


def mamba2_flops(m: ModelConfig, L: int) -> dict:
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


def mamba2_activation_bytes(m, a: int, ctx=None) -> tuple[int, int]:
    """(local, stream) bytes per token of a Mamba-2 mixer: in_proj output [z|x|B|C|dt] (conv and SSD read
    views of it), conv output (SSD's x, B, C), SSD output y (the gated norm's input), gated-norm output
    (out_proj's input); the Triton ops save only their inputs. When the norm groups span TP ranks (TP >
    ngroups) the norm also keeps its all-reduced sums of squares (G fp32 numbers per token; parallel/tp.py)."""
    gn = m.ngroups * m.d_state
    zxbcdt = 2 * m.d_inner + 2 * gn + m.nheads
    kept = _ssd_kept_state_bytes(m, a)
    spans = 4 * m.n_slots if m.norm_spans_ranks else 0
    return a * (zxbcdt + m.conv_dim + 2 * m.d_inner) + kept + spans, 0


def _ssd_kept_state_bytes(m, a: int) -> int:
    """Per token: the chunk states the SSD forward keeps for the backward under MEGASSM_SSD_SAVE_STATES=1
    (docs/kernels.md), H x P x N per chunk at 4 bytes (bf16 hi + lo planes, or fp32), 2 under
    MEGASSM_SSD_PRECISION=bf16 with bf16 autocast; 0 by default (the backward recomputes them). Not priced: the
    true segment ends a segmented chunk walk keeps (few long rows; segments x H x P x N x 4 bytes per row, ~1%
    of a Mamba-2 layer's activations at 1 x 16K, where the GPU decides the segment count)."""
    from megassm.kernels import env

    if not env.ssd_save_states():
        return 0
    fast = a == 2 and env.ssd_precision() == "bf16"
    return m.nheads * m.headdim * m.d_state * (2 if fast else 4) // m.chunk_size


def mamba2_tp_layout(mixer: Mamba2Mixer, ranks: int, sp: bool) -> TPLayout:
    """in_proj per component [z|x|B|C|dt] column-parallel, conv / A_log / dt_bias / D / norm weight
    rank-local, grouped norm over local groups, out_proj row-parallel. ranks > ngroups: B/C rows of in_proj and
    conv replicated, and the norm (whose group then spans ranks) becomes the `mamba2_norm_spans_ranks`
    variant."""
    H, G, N, di = mixer.nheads, mixer.ngroups, mixer.d_state, mixer.d_inner
    if H % ranks:
        raise ValueError(f"tensor parallelism: tp={ranks} must divide the Mamba-2 heads ({H})")
    if G % ranks and ranks % G:
        raise ValueError(f"tensor parallelism: Mamba-2 ngroups={G} and tp={ranks}: one must divide the other")
    gn = G * N
    spans = G % ranks != 0
    bc = Replicate(gn, G) if spans else Split(gn)
    zx, heads = Split(di), Split(H)
    in_pieces = (zx, zx, bc, bc, heads)
    lay = TPLayout()
    lay.params = {"in_proj.weight": Cut(0, in_pieces), "in_proj.bias": Cut(0, in_pieces),
                  "conv1d.weight": Cut(0, (zx, bc, bc)), "conv1d.bias": Cut(0, (zx, bc, bc))}
    lay.params.update({n: Cut(0, (heads,)) for n in ("dt_bias", "A_log", "D")})
    lay.params["norm.weight"] = Cut(0, (zx,))
    lay.params["out_proj.weight"] = Cut(1, (zx,))
    lay.params["out_proj.bias"] = Cut(0, (Replicate(mixer.d_model, 1, partial=sp),))
    g_local = 1 if spans else G // ranks
    dl, hl, gnl = di // ranks, H // ranks, g_local * N
    lay.sizes = {"d_inner": dl, "nheads": hl, "ngroups": g_local, "conv_dim": dl + 2 * gnl,
                 "in_proj_sizes": [dl, dl, gnl, gnl, hl], "conv_sizes": [dl, gnl, gnl], "norm.ngroups": g_local}
    lay.row_parallel = {"out_proj": sp}
    lay.entry = "in_proj"  # forward() and step() read u only through in_proj
    lay.aligned_out = ("in_proj",)  # its pieces are read through split_last / torch.split views
    if spans:
        lay.variants[""] = ("mamba2_norm_spans_ranks", {"groups": G, "group_size": di // G, "sp": sp})
    return lay


BLOCK_KIND = register(BlockKind(
    letter="M", name="Mamba-2", mixer=Mamba2Mixer, sections=("mamba",), state=MambaState,
    check=check_mamba_section, check_layout=_check_layout,
    flop_keys=("mamba_proj", "mamba_conv", "mamba_ssd"), flops=mamba2_flops,
    activation_bytes=mamba2_activation_bytes, tp_layout=mamba2_tp_layout,
    cp="mamba2", bptt=lambda mixer: "mamba", cuda_graph="yes", fsdp_bf16_gather=True,
))
