"""Pure-PyTorch reference for the selective (diagonal, input-dependent) scan of the seed mixers `S` (Mamba-1 /
S6) and `L` (Longhorn).

Per batch row, channel d, state index n (N states per channel; channel d reads B/C group d // (D/G)):

    delta_t = softplus(delta_raw_t + delta_bias)      (or delta_raw_t as given, delta_softplus=False)
    a_t     = exp(delta_t * A[d, n])                   decay="exp"       (Mamba-1: ZOH decay, A < 0)
            = 1 - delta_t * B_t[n]^2                   decay="longhorn"  (Longhorn eq. 7, delta = eps, B = k)
    h_t     = a_t * h_{t-1} + delta_t * x_t * B_t[n]   h: [D, N] fp32
    y_t     = (sum_n C_t[n] h_t[d, n] + D[d] x_t) * silu(z_t)

Both decays are the same diagonal linear recurrence h_t = a_t h_{t-1} + b_t, so one kernel serves both mixers.
`seq_idx` (document id per token, nondecreasing per row) resets the state to zero where the id changes
(a_t = 0 there); `initial_state` feeds only the first document of each row.

Three entry points with one semantics:
  selective_scan             chunked (what the mixers run on CPU; checked against the oracle),
  selective_scan_sequential  plain loop over time, the test oracle,
  selective_scan_step        one decode token.
All math runs in fp32 (fp64 when x is fp64, so tests can compare tightly); y comes back in x.dtype, states
stay in the compute dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["selective_scan", "selective_scan_sequential", "selective_scan_step", "DECAYS"]

DECAYS = ("exp", "longhorn")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def check_scan_args(x, delta, A, B, C, decay):
    """Shape and mode checks shared by every backend. B/C are [B, L, N] or grouped [B, L, G, N]."""
    if decay not in DECAYS:
        raise ValueError(f"selective_scan: decay must be one of {', '.join(DECAYS)}, got {decay!r}")
    if x.dim() != 3:
        raise ValueError(f"selective_scan: x must be [B, L, D], got {tuple(x.shape)}")
    b, l, d = x.shape
    if B.dim() not in (3, 4) or C.shape != B.shape or B.shape[:2] != (b, l):
        raise ValueError(f"selective_scan: B and C must be [B, L, N] or [B, L, G, N] matching x{tuple(x.shape)}, "
                         f"got B{tuple(B.shape)} C{tuple(C.shape)}")
    g = 1 if B.dim() == 3 else B.shape[2]
    n = B.shape[-1]
    if g < 1 or d % g:
        raise ValueError(f"selective_scan: groups ({g}) must divide the channels ({d})")
    if delta.shape != x.shape:
        raise ValueError(f"selective_scan: delta{tuple(delta.shape)} must match x{tuple(x.shape)}")
    if decay == "exp" and (A is None or A.shape != (d, n)):
        raise ValueError(f"selective_scan: decay='exp' needs A [D={d}, N={n}], got "
                         f"{None if A is None else tuple(A.shape)}")
    if decay == "longhorn" and A is not None:
        raise ValueError("selective_scan: decay='longhorn' has no A (its decay is 1 - delta * B^2); pass A=None")


def _prepare_delta(delta, delta_bias, delta_softplus, cdt):
    dt = delta.to(cdt)
    if delta_bias is not None:
        dt = dt + delta_bias.to(cdt)
    if delta_softplus:
        dt = F.softplus(dt)
    return dt


def _grouped(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 4 else t.unsqueeze(2)


def _decay_and_input(x, dt, A, Bg, decay, cdt):
    """a, b of h_t = a_t h_{t-1} + b_t for every (token, channel, state): [b, l, g, c, n] (channels split as
    (group, channel-in-group))."""
    bsz, seqlen, d = x.shape
    g, n = Bg.shape[2], Bg.shape[3]
    dtg = dt.view(bsz, seqlen, g, d // g, 1)
    Bf = Bg.to(cdt)[:, :, :, None, :]  # [b, l, g, 1, n]
    if decay == "exp":
        a = torch.exp(dtg * A.to(cdt).view(g, d // g, n))
    else:
        a = 1.0 - dtg * Bf * Bf
    u = (dtg * x.to(cdt).view(bsz, seqlen, g, d // g, 1)) * Bf
    return a, u


def _reset_mask(seq_idx, bsz, seqlen, device):
    """[b, l] bool: True where a new document starts (never at t = 0: the initial state feeds the first one)."""
    r = torch.zeros(bsz, seqlen, dtype=torch.bool, device=device)
    if seq_idx is not None and seqlen > 1:
        r[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return r


def _skip_and_gate(y, x, D, z, cdt):
    if D is not None:
        y = y + x.to(cdt) * D.to(cdt)
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y


def selective_scan(
    x,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    decay="exp",
    initial_state=None,
    seq_idx=None,
    return_final_state=False,
    chunk_size=32,
):
    """Chunked selective scan. x/delta/z [B, L, D], A [D, N] (decay="exp") or None ("longhorn"), B/C [B, L, N]
    or [B, L, G, N], D/delta_bias [D], initial_state [B, D, N], seq_idx [B, L] int. Returns y [B, L, D]
    (x.dtype) and, if asked, the final state [B, D, N] (fp32).

    Inside chunks of T tokens a doubling (Hillis-Steele) scan over the (a, b) pairs gives every token's state
    from a zero start and the decay product from the chunk start, in log2(T) elementwise passes; a short
    loop over chunks carries the state across them; each token then adds its decayed share of the chunk's
    incoming state. Multiplicative throughout (no logs, no differences of prefix sums), so it is exact where
    the decays underflow to 0 and at resets (a = 0).
    """
    check_scan_args(x, delta, A, B, C, decay)
    bsz, seqlen, d = x.shape
    Bg, Cg = _grouped(B), _grouped(C)
    g, n = Bg.shape[2], Bg.shape[3]
    cdt = _compute_dtype(x)
    dt = _prepare_delta(delta, delta_bias, delta_softplus, cdt)
    a, u = _decay_and_input(x, dt, A, Bg, decay, cdt)
    reset = _reset_mask(seq_idx, bsz, seqlen, x.device)
    a = a.masked_fill(reset.view(bsz, seqlen, 1, 1, 1), 0.0)
    if seqlen == 0:
        y = x.new_zeros(x.shape)
        h = x.new_zeros(bsz, d, n, dtype=cdt) if initial_state is None else initial_state.to(cdt)
        return (y, h) if return_final_state else y

    T = max(1, min(int(chunk_size), seqlen))
    nchunks = -(-seqlen // T)
    pad = nchunks * T - seqlen
    if pad:  # a = 1, b = 0: the state passes through unchanged, so the final state is the last real token's
        a = F.pad(a, (0, 0, 0, 0, 0, 0, 0, pad), value=1.0)
        u = F.pad(u, (0, 0, 0, 0, 0, 0, 0, pad))
    shape = (bsz, nchunks, T, g, d // g, n)
    a, u = a.view(shape), u.view(shape)
    k = 1
    while k < T:  # after the pass with offset k, each entry combines the 2k most recent tokens of its chunk
        u = torch.cat([u[:, :, :k], u[:, :, k:] + a[:, :, k:] * u[:, :, :-k]], dim=2)
        a = torch.cat([a[:, :, :k], a[:, :, k:] * a[:, :, :-k]], dim=2)
        k *= 2

    if initial_state is None:
        h = x.new_zeros(bsz, g, d // g, n, dtype=cdt)
    else:
        h = initial_state.to(cdt).view(bsz, g, d // g, n)
    incoming = []
    for c in range(nchunks):
        incoming.append(h)
        h = a[:, c, -1] * h + u[:, c, -1]
    states = u + a * torch.stack(incoming, dim=1)[:, :, None]  # [b, c, T, g, dc, n]
    y = torch.einsum("bctgdn,bctgn->bctgd", states,
                     F.pad(Cg.to(cdt), (0, 0, 0, 0, 0, pad)).view(bsz, nchunks, T, g, n))
    y = y.reshape(bsz, nchunks * T, d)[:, :seqlen]
    y = _skip_and_gate(y, x, D, z, cdt).to(x.dtype)
    if return_final_state:
        return y, h.reshape(bsz, d, n)
    return y


def selective_scan_sequential(
    x,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    decay="exp",
    initial_state=None,
    seq_idx=None,
    return_final_state=False,
    chunk_size=None,
):
    """Test oracle: the recurrence written literally, one token at a time (chunk_size is ignored)."""
    del chunk_size
    check_scan_args(x, delta, A, B, C, decay)
    bsz, seqlen, d = x.shape
    Bg, Cg = _grouped(B), _grouped(C)
    g, n = Bg.shape[2], Bg.shape[3]
    cdt = _compute_dtype(x)
    dt = _prepare_delta(delta, delta_bias, delta_softplus, cdt)
    Bd = Bg.to(cdt).repeat_interleave(d // g, dim=2)  # [b, l, d, n]
    Cd = Cg.to(cdt).repeat_interleave(d // g, dim=2)
    xf = x.to(cdt)
    state = x.new_zeros(bsz, d, n, dtype=cdt) if initial_state is None else initial_state.to(cdt)
    ys = []
    for t in range(seqlen):
        if seq_idx is not None and t > 0:
            new_doc = (seq_idx[:, t] != seq_idx[:, t - 1]).view(bsz, 1, 1)
            state = torch.where(new_doc, torch.zeros_like(state), state)
        dtt = dt[:, t, :, None]
        if decay == "exp":
            a = torch.exp(dtt * A.to(cdt))
        else:
            a = 1.0 - dtt * Bd[:, t] ** 2
        state = a * state + (dtt * xf[:, t, :, None]) * Bd[:, t]
        ys.append((state * Cd[:, t]).sum(-1))
    y = torch.stack(ys, dim=1) if ys else xf.new_zeros(x.shape)
    y = _skip_and_gate(y, x, D, z, cdt).to(x.dtype)
    return (y, state) if return_final_state else y


def selective_scan_step(state, x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                        decay="exp"):
    """One decode token. state [B, D, N] (fp32), x/delta/z [B, D], B/C [B, N] or [B, G, N].

    Returns (y [B, D] in x.dtype, new_state fp32). Document resets are the caller's job (zero the state
    first). The input state is not modified.
    """
    y, new = selective_scan_sequential(
        x[:, None], delta[:, None], A, B[:, None], C[:, None], D=D, z=None if z is None else z[:, None],
        delta_bias=delta_bias, delta_softplus=delta_softplus, decay=decay, initial_state=state,
        return_final_state=True)
    return y[:, 0], new
