"""Pure-PyTorch reference for the Mamba-2 SSD (state space duality) scan.

Recurrence, per batch row b, head h (P = headdim, N = state size):

    dt_t = clamp(softplus(dt_raw_t + dt_bias), dt_limit)
    h_t  = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t        h_t: [P, N]
    y_t  = (C_t . h_t + D * x_t) * silu(z_t)

Head h reads B/C group h // (H // G). `seq_idx` (document id per token, nondecreasing per row) resets the
state to zero where the id changes; `initial_states` feeds only the first document of each row.

Three entry points with one semantics:
  ssd            chunked algorithm (what the model runs on CPU; the oracle-checked reference for Triton),
  ssd_sequential plain loop over time, the test oracle,
  ssd_step       one decode token.
All math runs in fp32 (fp64 when x is fp64, so tests can compare tightly); y comes back in x.dtype, states
stay in the compute dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["ssd", "ssd_sequential", "ssd_step", "segsum"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # fp32 at least; fp64 inputs stay fp64 (oracle comparisons in tests).
    return torch.promote_types(x.dtype, torch.float32)


def _prepare_dt(dt, dt_bias, dt_softplus, dt_limit, cdt):
    dt = dt.to(cdt)
    if dt_bias is not None:
        dt = dt + dt_bias.to(cdt)
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit is not None:
        lo, hi = dt_limit
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _skip_and_gate(y, x, D, z, cdt):
    """y + D*x, then * silu(z). y, x, z: [..., H, P]; D: [H] or [H, P]."""
    if D is not None:
        Df = D.to(cdt)
        y = y + x.to(cdt) * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y


def check_ssd_args(x, dt, A, B, C):
    b, l, h, p = x.shape
    g = B.shape[-2]
    if h % g != 0:
        raise ValueError(f"ssd: heads ({h}) must be a multiple of groups ({g})")
    if dt.shape != (b, l, h) or A.shape != (h,) or B.shape[:3] != (b, l, g) or C.shape != B.shape:
        raise ValueError(
            f"ssd: inconsistent shapes x{tuple(x.shape)} dt{tuple(dt.shape)} A{tuple(A.shape)} "
            f"B{tuple(B.shape)} C{tuple(C.shape)}"
        )


def segsum(a: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = a[..., j+1] + ... + a[..., i] for j <= i, -inf above the diagonal.

    exp(segsum(log_decay)) is the decay matrix of a scalar-decay linear recurrence. Summing only the terms of
    each segment (cumsum down a masked copy) instead of differencing two prefix sums keeps it exact when the
    prefix sums are large: cs_i - cs_j in fp32 loses ~|cs| * 1e-7 absolute, i.e. visible relative error in
    exp() once decays have accumulated to thousands.
    """
    t = a.shape[-1]
    rep = a[..., :, None].expand(*a.shape, t)  # rep[..., i, j] = a[..., i]
    strict = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)  # keep i > j
    out = rep.masked_fill(~strict, 0).cumsum(dim=-2)  # sum over i' in (j, i]
    causal = torch.ones(t, t, dtype=torch.bool, device=a.device).tril()
    return out.masked_fill(~causal, -math.inf)


def ssd(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=True,
    dt_limit=None,
    initial_states=None,
    seq_idx=None,
    chunk_size=256,
    return_final_states=False,
):
    """Chunked SSD. x [B,L,H,P], dt [B,L,H], A [H], B/C [B,L,G,N], D [H] or [H,P], z [B,L,H,P],
    dt_bias [H], initial_states [B,H,P,N], seq_idx [B,L] int. Returns y [B,L,H,P] (x.dtype) and, if
    asked, the final state [B,H,P,N] (fp32).

    Per chunk of T tokens: (1) outputs from inside the chunk by a masked quadratic form (C B^T * decay),
    (2) each chunk's own end state, (3) states passed across chunks by the same decay-matrix form on the
    chunk totals, (4) the incoming state read out by every token of the chunk. Document resets are masks:
    a pair of positions (token/token, chunk-end/chunk-end, chunk-start/token) interacts only if both carry
    the same document id, which, ids being nondecreasing, means no reset lies between them.
    """
    check_ssd_args(x, dt, A, B, C)
    bsz, seqlen, nheads, hdim = x.shape
    ngroups, dstate = B.shape[-2:]
    rep = nheads // ngroups
    cdt = _compute_dtype(x)

    dt = _prepare_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)
    T = max(1, min(chunk_size, seqlen))  # a chunk longer than the sequence is only padding
    nchunks = -(-seqlen // T)
    pad = nchunks * T - seqlen

    # Pad the tail: dt = 0 (no decay) and x = 0 (no input) leave the state untouched, so the final state is
    # the state after the last real token. Padding is done after softplus so padded dt really is 0.
    xf, Bf, Cf = x.to(cdt), B.to(cdt), C.to(cdt)
    if pad:
        xf = F.pad(xf, (0, 0, 0, 0, 0, pad))
        Bf = F.pad(Bf, (0, 0, 0, 0, 0, pad))
        Cf = F.pad(Cf, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))

    # Heads are split as (group, head-in-group) so C.B^T is computed once per group, not once per head.
    xc = xf.view(bsz, nchunks, T, ngroups, rep, hdim)
    Bc = Bf.view(bsz, nchunks, T, ngroups, dstate)
    Cc = Cf.view(bsz, nchunks, T, ngroups, dstate)
    dtc = dt.view(bsz, nchunks, T, ngroups, rep)
    xdt = xc * dtc[..., None]  # input term dt_s * x_s
    # log-decay per step, laid out [b, g, r, c, t] so the time axis is last for cumsum/segsum
    dA = (dtc * A.to(cdt).view(ngroups, rep)).permute(0, 3, 4, 1, 2)
    dA_cs = dA.cumsum(dim=-1)  # from chunk start: plain prefix sum, never differenced

    if seq_idx is not None:
        sid = seq_idx
        if pad:
            sid = torch.cat([sid, sid[:, -1:].expand(bsz, pad)], dim=1)
        sid = sid.view(bsz, nchunks, T)
        # doc id owning the state that enters chunk c: end of chunk c-1, or the row's first doc for c = 0
        # (that is where initial_states lives).
        sid_in = torch.cat([seq_idx[:, :1], sid[:, :-1, -1]], dim=1)  # [b, c]

    # (1) intra-chunk: y_t += sum_{s<=t, same doc} (C_t . B_s) exp(dA_{s+1} + .. + dA_t) dt_s x_s
    logL = segsum(dA)  # [b, g, r, c, t, s]
    if seq_idx is not None:
        same_doc = sid[:, :, :, None] == sid[:, :, None, :]  # [b, c, t, s]
        logL = logL.masked_fill(~same_doc[:, None, None], -math.inf)
    L = torch.exp(logL)
    CB = torch.einsum("bctgn,bcsgn->bgcts", Cc, Bc)
    y = torch.einsum("bgrcts,bcsgrp->bctgrp", L * CB[:, :, None], xdt)

    # (2) each chunk's own end state (from a zero start). The decay s -> chunk end is the last row of the
    # segsum matrix: exact, and already zero for tokens of an earlier document than the chunk's last token.
    decay_to_end = L[..., -1, :]  # [b, g, r, c, s]
    chunk_states = torch.einsum("bcsgn,bgrcs,bcsgrp->bcgrpn", Bc, decay_to_end, xdt)

    # (3) inter-chunk passing. Entry 0 is the initial state, entry k >= 1 the end state of chunk k-1.
    # state_in[k] = sum_{j<=k, same doc} exp(total_{j} + .. + total_{k-1}) * entry[j]  (chunk totals).
    if initial_states is None:
        h0 = xc.new_zeros(bsz, 1, ngroups, rep, hdim, dstate)
    else:
        h0 = initial_states.to(cdt).view(bsz, 1, ngroups, rep, hdim, dstate)
    entries = torch.cat([h0, chunk_states], dim=1)  # [b, c+1, g, r, p, n]
    log_pass = segsum(F.pad(dA_cs[..., -1], (1, 0)))  # [b, g, r, c+1, c+1]
    if seq_idx is not None:
        ends = torch.cat([sid_in, sid[:, -1:, -1]], dim=1)  # doc id of each entry, [b, c+1]
        pass_ok = ends[:, :, None] == ends[:, None, :]
        log_pass = log_pass.masked_fill(~pass_ok[:, None, None], -math.inf)
    states = torch.einsum("bgrkj,bjgrpn->bkgrpn", torch.exp(log_pass), entries)
    state_in, final_state = states[:, :-1], states[:, -1]

    # (4) incoming state read out inside the chunk, decayed from the chunk start; cut after a reset.
    decay_in = dA_cs
    if seq_idx is not None:
        alive = sid == sid_in[:, :, None]  # [b, c, t]
        decay_in = decay_in.masked_fill(~alive[:, None, None], -math.inf)
    y = y + torch.einsum("bctgn,bcgrpn,bgrct->bctgrp", Cc, state_in, torch.exp(decay_in))

    y = y.reshape(bsz, nchunks * T, nheads, hdim)[:, :seqlen]
    y = _skip_and_gate(y, x, D, z, cdt).to(x.dtype)
    if return_final_states:
        return y, final_state.reshape(bsz, nheads, hdim, dstate)
    return y


def ssd_sequential(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=True,
    dt_limit=None,
    initial_states=None,
    seq_idx=None,
    chunk_size=256,
    return_final_states=False,
):
    """Test oracle: the recurrence written literally, one token at a time (chunk_size is ignored)."""
    del chunk_size
    check_ssd_args(x, dt, A, B, C)
    bsz, seqlen, nheads, hdim = x.shape
    rep = nheads // B.shape[-2]
    cdt = _compute_dtype(x)
    dt = _prepare_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)
    xf, Af = x.to(cdt), A.to(cdt)
    Bh = B.to(cdt).repeat_interleave(rep, dim=2)  # [b, l, h, n]
    Ch = C.to(cdt).repeat_interleave(rep, dim=2)
    if initial_states is None:
        state = xf.new_zeros(bsz, nheads, hdim, Bh.shape[-1])
    else:
        state = initial_states.to(cdt)
    ys = []
    for t in range(seqlen):
        if seq_idx is not None and t > 0:
            reset = (seq_idx[:, t] != seq_idx[:, t - 1]).view(bsz, 1, 1, 1)
            state = torch.where(reset, torch.zeros_like(state), state)
        decay = torch.exp(dt[:, t] * Af)[:, :, None, None]
        inp = (dt[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
        state = decay * state + inp
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1) if ys else xf.new_zeros(x.shape)
    y = _skip_and_gate(y, x, D, z, cdt).to(x.dtype)
    return (y, state) if return_final_states else y


def ssd_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=None):
    """One decode token. state [B,H,P,N] (fp32), x [B,H,P], dt [B,H], B/C [B,G,N], z [B,H,P].

    Returns (y [B,H,P] in x.dtype, new_state in fp32). Document resets are the caller's job (zero the state
    first). The input state is not modified.
    """
    nheads = x.shape[1]
    rep = nheads // B.shape[1]
    cdt = _compute_dtype(x)
    dt = _prepare_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)  # [b, h]
    Bh = B.to(cdt).repeat_interleave(rep, dim=1)  # [b, h, n]
    Ch = C.to(cdt).repeat_interleave(rep, dim=1)
    xf = x.to(cdt)
    decay = torch.exp(dt * A.to(cdt))[:, :, None, None]
    new_state = decay * state.to(cdt) + (dt[..., None] * xf)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    y = _skip_and_gate(y, x, D, z, cdt).to(x.dtype)
    return y, new_state
