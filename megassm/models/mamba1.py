"""Mamba-1 (S6) mixer (`S`), and the block it shares with Longhorn (`L`, models/longhorn.py).

    x, z     = in_proj(u)                      d_model -> [x | z] = [d_inner, d_inner]
    x        = silu(causal_conv1d(x))          depthwise, width d_conv
    dt_low, B, C = x_proj(x)                   d_inner -> [R | N | N]  (no bias)
    y        = scan(x, dt_low, B, C) + D x     the mixer's selective scan, state [d_inner, N] per row
    y        = y * silu(z)
    out      = out_proj(y)                     d_inner -> d_model

Mamba-1's scan: dt = softplus(dt_proj.weight @ dt_low + dt_proj.bias), A = -exp(A_log) [d_inner, N],
h_t = exp(dt A) h_{t-1} + dt x B, y = C . h (megassm.kernels.selective_scan, decay="exp"; the dt bias and the
softplus run inside the kernel, in fp32). Init (`init: paper`, mamba_ssm's): A_log = log(1..N) in every row
(S4D-real, A_n = -(n+1)), dt_proj.bias = softplus^-1(dt) with dt log-uniform in [dt_min, dt_max] floored,
dt_proj.weight ~ U(+-R^-1/2), D = 1, in_proj / x_proj ~ U(+-1/sqrt(fan_in)), out_proj the same / sqrt(blocks).
A_log, D and the biases are fp32 and never weight-decayed.

`model.mamba1.lti=true` is the Mamba paper's LTI ablation (Table 1, selective copying): the same block with
dt = softplus(dt_bias) per channel and B, C learned [N] vectors, none of them a function of x (no x_proj, no
dt_proj; the same scan kernel with the constants broadcast over batch and time).

Tensor-parallel layout (`scan_tp_layout` below, applied from outside by parallel/tp.py): in_proj rows [x | z] and every
per-channel tensor (conv, dt_proj rows, A_log, D) split by channel; x_proj contracts over all d_inner channels,
so its small output (R + 2N per token) is all-reduced (the first of two all-reduces per layer); out_proj is
row-parallel (the second).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megassm import kernels
from megassm.config import ModelConfig, scan_dims

from .init import InitRule
from .mamba2 import CausalConv1d
from .registry import BlockKind, Cut, Replicate, Split, TPLayout, register
from .state import ScanState

__all__ = ["SelectiveScanMixer", "Mamba1Mixer"]


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def ruled_linear(fan_in: int, fan_out: int, bias: bool, weight_rule: InitRule) -> nn.Linear:
    lin = nn.Linear(fan_in, fan_out, bias=bias)
    lin.init_rules = {"weight": weight_rule, "bias": InitRule("zeros", no_wd=True)}
    return lin


class SelectiveScanMixer(nn.Module):
    """The Mamba-1 block around a selective scan; subclasses supply the scan (`scan`, `scan_step`) and its
    parameters. `sec` is the config section (model.mamba1 / model.longhorn), `letter` the pattern letter."""

    stateful = True

    def __init__(self, cfg: ModelConfig, n_layer: int, sec, letter: str):
        super().__init__()
        dims = scan_dims(cfg, letter)
        self.d_model = cfg.d_model
        self.d_inner = dims["d_inner"]
        self.d_state = sec.d_state
        self.d_conv = sec.d_conv
        self.dt_rank = dims["dt_rank"]
        di, d = self.d_inner, cfg.d_model
        if sec.init == "paper":  # nn.Linear's default U(+-1/sqrt(fan_in)); out_proj rescaled by the depth
            w_in = InitRule("uniform", low=-1 / math.sqrt(d), high=1 / math.sqrt(d))
            w_x = InitRule("uniform", low=-1 / math.sqrt(di), high=1 / math.sqrt(di))
            b_out = 1 / math.sqrt(di) / math.sqrt(n_layer)
            w_out = InitRule("uniform", low=-b_out, high=b_out)
        elif sec.init == "normal":  # the Mamba-2 mixer's convention
            w_in = w_x = InitRule("normal", std=cfg.init_std)
            w_out = InitRule("normal", std=cfg.init_std / math.sqrt(2 * n_layer))
        else:
            raise ValueError(f"unknown init {sec.init!r} (expected paper or normal)")
        self.in_proj = ruled_linear(d, 2 * di, sec.proj_bias, w_in)  # rows [x | z]
        self.conv1d = CausalConv1d(di, sec.d_conv, bias=sec.conv_bias)
        self.x_proj = ruled_linear(di, self.dt_rank + 2 * self.d_state, False, w_x)  # [dt_low | B | C]
        self.D = nn.Parameter(torch.empty(di, dtype=torch.float32))
        self.out_proj = ruled_linear(di, d, sec.proj_bias, w_out)
        self.init_rules = {"D": InitRule("ones", no_wd=True)}

    def _low_rank_rule(self) -> InitRule:
        bound = self.dt_rank ** -0.5
        return InitRule("uniform", low=-bound, high=bound)

    # ------------------------------------------------------------------------------------------------
    def allocate_state(self, batch_size: int, device=None) -> ScanState:
        return ScanState(
            conv=torch.zeros(batch_size, self.d_inner, self.d_conv - 1, device=device, dtype=torch.float32),
            ssm=torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=torch.float32),
        )

    def _split_proj(self, x: torch.Tensor):
        return torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)

    def forward(
        self,
        u: torch.Tensor,
        seq_idx: torch.Tensor | None = None,
        state: ScanState | None = None,
        return_state: bool = False,
    ) -> tuple[torch.Tensor, ScanState | None]:
        """u [B, L, d_model]; seq_idx [B, L] document ids; state: carried into the first document of each row.
        Returns (out [B, L, d_model], final state or None)."""
        x, z = torch.split(self.in_proj(u), [self.d_inner, self.d_inner], dim=-1)
        x, conv_state = self.conv(x, seq_idx, None if state is None else state.conv, return_state)
        dt_low, Bm, Cm = self._split_proj(x)
        out = self.scan(x, dt_low, Bm, Cm, z, seq_idx, None if state is None else state.ssm, return_state)
        y, ssm_state = out if return_state else (out, None)
        new_state = ScanState(conv=_fp32(conv_state), ssm=_fp32(ssm_state)) if return_state else None
        return self.out_proj(y), new_state

    def conv(self, x, seq_idx, conv_state, return_state):
        """silu(causal_conv1d(x)) [B, L, d_inner] and, if asked, the final conv state (else None)."""
        out = kernels.causal_conv1d(x, self.conv1d.weight, self.conv1d.bias, initial_state=conv_state,
                                    seq_idx=seq_idx, activation="silu", return_final_state=return_state)
        return out if return_state else (out, None)

    def step(self, u: torch.Tensor, state: ScanState) -> tuple[torch.Tensor, ScanState]:
        """One token: u [B, d_model] -> (out [B, d_model], new state). Resets are applied by the caller."""
        x, z = torch.split(self.in_proj(u), [self.d_inner, self.d_inner], dim=-1)
        x, conv_state = kernels.causal_conv1d_step(state.conv, x, self.conv1d.weight, self.conv1d.bias,
                                                   activation="silu")
        dt_low, Bm, Cm = self._split_proj(x)
        y, ssm_state = self.scan_step(state.ssm, x, dt_low, Bm, Cm, z)
        return self.out_proj(y), ScanState(conv=_fp32(conv_state), ssm=_fp32(ssm_state))

    def scan(self, x, dt_low, Bm, Cm, z, seq_idx, ssm_state, return_state):
        raise NotImplementedError

    def scan_step(self, ssm_state, x, dt_low, Bm, Cm, z):
        raise NotImplementedError


class Mamba1Mixer(SelectiveScanMixer):
    def __init__(self, cfg: ModelConfig, n_layer: int):
        mc = cfg.mamba1
        super().__init__(cfg, n_layer, mc, "S")
        dt_rule = InitRule("dt_bias", low=mc.dt_min, high=mc.dt_max, floor=mc.dt_init_floor, no_wd=True)
        self.lti = mc.lti
        if self.lti:  # time-invariant ablation: constants in place of the input-dependent projections
            del self.x_proj
            self.dt_bias = nn.Parameter(torch.empty(self.d_inner, dtype=torch.float32))
            self.B_lti = nn.Parameter(torch.empty(self.d_state, dtype=torch.float32))
            self.C_lti = nn.Parameter(torch.empty(self.d_state, dtype=torch.float32))
            self.init_rules.update(dt_bias=dt_rule, B_lti=InitRule("ones", no_wd=True),
                                   C_lti=InitRule("normal", std=self.d_state ** -0.5, no_wd=True))
        else:
            self.dt_proj = ruled_linear(self.dt_rank, self.d_inner, True, self._low_rank_rule())
            self.dt_proj.init_rules["bias"] = dt_rule
        self.A_log = nn.Parameter(torch.empty(self.d_inner, self.d_state, dtype=torch.float32))
        self.init_rules["A_log"] = InitRule("s4d_real", no_wd=True)

    def _split_proj(self, x: torch.Tensor):
        if not self.lti:
            return super()._split_proj(x)
        shape = (*x.shape[:-1], self.d_state)
        return None, self.B_lti.to(x.dtype).expand(shape).contiguous(), self.C_lti.to(x.dtype).expand(shape).contiguous()

    def _delta(self, dt_low: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(delta before its bias, the bias): the kernel adds the bias and applies softplus in fp32."""
        if self.lti:
            return torch.zeros_like(x), self.dt_bias
        return F.linear(dt_low, self.dt_proj.weight), self.dt_proj.bias

    def _A(self) -> torch.Tensor:
        # at least fp32 (fp64 stays fp64, so the oracle tests can compare tightly)
        return -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))

    def scan(self, x, dt_low, Bm, Cm, z, seq_idx, ssm_state, return_state):
        """y [B, L, d_inner] (x.dtype) with the D skip and the z gate, and the final state if asked."""
        delta, bias = self._delta(dt_low, x)
        return kernels.selective_scan(
            x, delta, self._A(), Bm, Cm, D=self.D, z=z, delta_bias=bias, delta_softplus=True, decay="exp",
            initial_state=ssm_state, seq_idx=seq_idx, return_final_state=return_state)

    def scan_step(self, ssm_state, x, dt_low, Bm, Cm, z):
        delta, bias = self._delta(dt_low, x)
        return kernels.selective_scan_step(ssm_state, x, delta, self._A(), Bm, Cm, D=self.D, z=z, delta_bias=bias,
                                           delta_softplus=True, decay="exp")


# ----------------------------------------------------------------------------------------------------
# the block kind `S` (and what Longhorn `L` shares with it)
# ----------------------------------------------------------------------------------------------------
def check_scan_section(cfg, need, letter: str, key: str) -> None:
    """model.mamba1.* / model.longhorn.*: the selective-scan block's section."""
    m, p = cfg.model, cfg.parallel
    sec, k = getattr(m, key), f"model.{key}"
    need(sec.d_state >= 1, f"{k}.d_state must be >= 1, got {sec.d_state}")
    need(sec.expand >= 1, f"{k}.expand must be >= 1, got {sec.expand}")
    need(2 <= sec.d_conv <= 4, f"{k}.d_conv must be 2..4, got {sec.d_conv}")
    need(sec.dt_rank is None or sec.dt_rank >= 1, f"{k}.dt_rank must be >= 1 (or unset: ceil(d_model/16)), "
                                                   f"got {sec.dt_rank}")
    need(sec.init in ("paper", "normal"), f"{k}.init must be paper or normal, got '{sec.init}'")
    need(scan_dims(m, letter)["d_inner"] % p.tp == 0,
         f"parallel.tp={p.tp} must divide {k}.expand x model.d_model = {scan_dims(m, letter)['d_inner']}")


def _check(cfg, need) -> None:
    check_scan_section(cfg, need, "S", "mamba1")
    s1, p = cfg.model.mamba1, cfg.parallel
    need(0 < s1.dt_min <= s1.dt_max,
         f"model.mamba1.dt_min={s1.dt_min} must be in (0, model.mamba1.dt_max={s1.dt_max}]")
    need(s1.dt_init_floor >= 0, f"model.mamba1.dt_init_floor must be >= 0, got {s1.dt_init_floor}")
    need(not (s1.lti and p.tp > 1), f"model.mamba1.lti=true with parallel.tp={p.tp}: the LTI ablation is a "
                                    "single-device research setting and has no tensor-parallel plan")


def scan_flops(m: ModelConfig, L: int, letter: str) -> dict:
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


def scan_activation_bytes(m, a: int, letter: str) -> int:
    """in_proj [x|z], conv out, x_proj out, y; then the step size. S: dt_proj's output (the kernel adds the
    bias). L: eps = beta / (1 + beta |k|^2) is built in fp32 (models/longhorn.py), which saves sigmoid's output
    and the denominator, and the kernel saves eps."""
    di = m.d_inner
    n = getattr(m, "d_state", 16)
    r = getattr(m, "dt_rank", 0)
    local = a * (4 * di + r + 2 * n)
    return local + (a * di if letter == "S" else 12 * di)


def scan_tp_layout(mixer, ranks: int, sp: bool) -> TPLayout:
    """Channels split across ranks; x_proj row-parallel with its small output (dt_low, B, C: R + 2N per
    token) all-reduced because every channel needs it (the first all-reduce), out_proj row-parallel (the
    second). SP: all-gather in, the x_proj all-reduce, reduce-scatter out."""
    di = mixer.d_inner
    if di % ranks:
        raise ValueError(f"tensor parallelism: tp={ranks} must divide the {type(mixer).__name__} channels ({di})")
    ch = Split(di)
    lay = TPLayout()
    lay.params = {"in_proj.weight": Cut(0, (ch, ch)), "in_proj.bias": Cut(0, (ch, ch))}
    for n in ("conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias", "beta_proj.weight",
              "beta_proj.bias", "A_log", "D"):
        lay.params[n] = Cut(0, (ch,))
    lay.params["x_proj.weight"] = Cut(1, (ch,))
    lay.params["out_proj.weight"] = Cut(1, (ch,))
    lay.params["out_proj.bias"] = Cut(0, (Replicate(mixer.d_model, 1, partial=sp),))
    lay.sizes = {"d_inner": di // ranks}
    lay.replicated_row = ("x_proj",)
    lay.row_parallel = {"out_proj": sp}
    return lay


BLOCK_KIND = register(BlockKind(
    letter="S", name="Mamba-1", mixer=Mamba1Mixer, sections=("mamba1",), state=ScanState, check=_check,
    flop_keys=("mamba1_proj", "mamba1_conv", "mamba1_scan"), flops=lambda m, L: scan_flops(m, L, "S"),
    activation_bytes=lambda mixer, a, ctx: (scan_activation_bytes(mixer, a, "S"), 0),
    tp_layout=scan_tp_layout, cp=None, bptt=None, cuda_graph="yes",
))
