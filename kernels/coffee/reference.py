"""Pure-PyTorch COFFEE recurrence (Zattra et al., "Context-Selective State Space Models: Feedback is All You
Need", eq. 7): the sequential reference, one decode step, and the parallel DEER Newton solver whose backward
is the adjoint (implicit) linear recurrence.

Per channel i and state j (u [B, L, D], lam / w [D, n], state x [B, D, n]):

    g_k = sigmoid(w * x_(k-1))                       the gate sees only the state (state feedback)
    x_k = x_(k-1) + g_k * (lam * x_(k-1) + u_k)      =: f(x_(k-1), u_k)

i.e. D*n independent scalar recurrences, nonlinear in the state, so no chunked (SSD) form exists. The
elementwise Jacobian is

    J_k = df/dx_(k-1) = 1 + lam * g_k + w * g_k * (1 - g_k) * (lam * x_(k-1) + u_k).

DEER (Lim et al. 2023): guess every state X; linearize f around the guess, x_k ~ F_k + J_k (x_(k-1) - Xp_k)
with Xp the guess shifted by one step; solve that *linear* recurrence for all k at once with a parallel scan;
repeat. The Jacobian is diagonal here, so quasi-DEER is exact Newton. Two properties make it safe:
  * prefix exactness: after i iterations x_0 .. x_(i-1) are exact (x_0 depends only on the known x_(-1)), so
    L iterations always reach the sequential answer;
  * any slope used in the scan leaves the fixed point unchanged (X = f(shift(X)) there). Full Newton can
    blow up where |J| > 1 (the w*sigmoid' term) compounds along a bad guess, so a step whose residual is
    non-finite or grows is redone with slopes clamped to [-1, 1] (cannot blow up; linear rate there);
    `jac_clip` > 0 clamps every step.
Convergence is checked on the fixed-point residual |x_k - f(x_(k-1))| <= tol * (1 + |x_k|) per state, and
positions before the first miss are frozen (later solves work on the suffix only). At the iteration cap the
suffix is finished by the sequential loop (fallback=True), so the result is exact in every case.
Backward (implicit differentiation through the converged trajectory, no unrolled iterations): the adjoint
G_k = dL/dx_k (total) obeys G_k = gX_k + J_(k+1) G_(k+1), a reverse linear scan with the *exact* J; then
dL/du_k = sum_j G_k g_k, dL/dlam = sum G g x_(k-1), dL/dw = sum G g (1 - g) x_(k-1) (lam x_(k-1) + u_k),
dL/dx_(-1) = J_0 G_0. This is the same gradient as autograd through the sequential loop.

Document resets (`seq_idx`, ids nondecreasing per row): at a position where the id changes the previous state
is 0 (x_(-1) = x0 feeds only position 0). All math in fp32 at least (fp64 stays fp64, for tight tests).
"""
from __future__ import annotations

import logging
import math

import torch

__all__ = ["coffee_step", "coffee_sequential", "coffee_scan", "coffee_readout", "coffee_deer", "linear_scan",
           "doc_starts", "DeerInfo"]

log = logging.getLogger("megassm.coffee")
_WARNED: set = set()


def _cdt(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def doc_starts(seq_idx: torch.Tensor | None) -> torch.Tensor | None:
    """[B, L] bool: True where position k > 0 starts a new document (its previous state is 0)."""
    if seq_idx is None:
        return None
    start = torch.zeros(seq_idx.shape, dtype=torch.bool, device=seq_idx.device)
    start[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return start


def coffee_step(x: torch.Tensor, u: torch.Tensor, lam: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One token: x [B, D, n], u [B, D] -> the new state [B, D, n] (compute dtype)."""
    cdt = _cdt(u)
    x = x.to(cdt)
    lam, w = lam.to(cdt), w.to(cdt)
    g = torch.sigmoid(w * x)
    return x + g * (lam * x + u.to(cdt)[..., None])


def coffee_sequential(u, lam, w, x0=None, seq_idx=None) -> torch.Tensor:
    """The oracle: a plain loop over time (differentiable by autograd). u [B, L, D], lam/w [D, n], x0 [B, D, n]
    or None (zeros), seq_idx [B, L]. Returns every state X [B, L, D, n] in the compute dtype."""
    bsz, seqlen, dim = u.shape
    cdt = _cdt(u)
    x = torch.zeros(bsz, dim, lam.shape[-1], dtype=cdt, device=u.device) if x0 is None else x0.to(cdt)
    keep = None if seq_idx is None else (~doc_starts(seq_idx)).to(cdt)
    xs = []
    for k in range(seqlen):
        if keep is not None and k > 0:
            x = x * keep[:, k, None, None]
        x = coffee_step(x, u[:, k], lam, w)
        xs.append(x)
    return torch.stack(xs, dim=1)


def coffee_readout(X: torch.Tensor, C: torch.Tensor, w_out: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., D] from the states X [..., D, n]: C . x per channel, times sigmoid(w_out . x) with the filter."""
    y = (C.to(X.dtype) * X).sum(-1)
    if w_out is not None:
        y = y * torch.sigmoid((w_out.to(X.dtype) * X).sum(-1))
    return y


def coffee_scan(u, lam, w, C, w_out=None, x0=None, seq_idx=None):
    """The sequential recurrence and its read-out: (y [B, L, D], final state [B, D, n]), compute dtype. The
    reference of the fused Triton kernel (triton_coffee.py)."""
    X = coffee_sequential(u, lam, w, x0, seq_idx)
    return coffee_readout(X, C, w_out), X[:, -1]


def linear_scan(a: torch.Tensor, b: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """h_k = a_k * h_(k-1) + b_k along dim 1 with h_(-1) = 0 (reverse: h_k = a_k * h_(k+1) + b_k, h_L = 0), for
    any real a (zero and negative slopes included: no logarithms, no division). Hillis-Steele doubling:
    ceil(log2 L) elementwise passes."""
    if reverse:
        a, b = a.flip(1), b.flip(1)
    seqlen = a.shape[1]
    s = 1
    while s < seqlen:
        b = torch.cat([b[:, :s], torch.addcmul(b[:, s:], a[:, s:], b[:, :-s])], dim=1)
        if 2 * s < seqlen:  # the products are needed only for a further pass
            a = torch.cat([a[:, :s], a[:, s:] * a[:, :-s]], dim=1)
        s *= 2
    return b.flip(1) if reverse else b


def _shift(X: torch.Tensor, x0: torch.Tensor | None, start: torch.Tensor | None) -> torch.Tensor:
    """Xp_k = X_(k-1): x0 (or 0) at k = 0, 0 at document starts."""
    first = torch.zeros_like(X[:, :1]) if x0 is None else x0[:, None].to(X.dtype)
    Xp = torch.cat([first, X[:, :-1]], dim=1)
    if start is not None:
        Xp = Xp.masked_fill(start[:, :, None, None], 0.0)
    return Xp


def _f_jac(Xp, u, lam, w):
    """F = f(Xp, u), J = df/dx at Xp, and the gate g. u [B, L, D] broadcast over the n states."""
    g = torch.sigmoid(w * Xp)
    s = lam * Xp + u[..., None]
    F = Xp + g * s
    J = 1.0 + lam * g + w * g * (1.0 - g) * s
    return F, J, g, s


def _known(start: torch.Tensor | None, bsz: int, seqlen: int, device) -> torch.Tensor:
    """[B, L] bool: the previous state is known exactly (k = 0, or a document start): the scan slope is 0."""
    known = torch.zeros(bsz, seqlen, dtype=torch.bool, device=device)
    known[:, 0] = True
    return known if start is None else known | start


class DeerInfo(dict):
    """{"iters": Newton solves (parallel scans) run, "rejected": full steps redone with clamped slopes,
    "residual": relative fixed-point residual max |x_k - f(x_(k-1))| / (1 + |x_k|) of the last iterate
    (before any fallback), "converged": residual <= tol,
    "fallback": the unconverged suffix was finished by the sequential loop (iteration cap, or a non-finite
    iterate)}."""


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(msg, *args)


def _residual(X, F, tol):
    """Per position: does some state miss the recurrence, |x_k - f(x_(k-1))| > tol * (1 + |x_k|)? And the
    largest relative miss. (Elementwise scale: a blown-up iterate cannot hide behind its own magnitude.)"""
    rel = (X - F).abs() / (1.0 + X.abs())
    over = ~(rel <= tol)  # NaN counts as a miss
    return over.any(dim=(0, 2, 3)), rel.amax()


@torch.no_grad()
def _deer_solve(u, lam, w, x0, start, tol, max_iters, jac_clip, fallback=True, growth=100.0):
    """Newton iterations on the unconverged suffix.

    The residual of the current iterate is checked first: positions before the first one that misses the
    recurrence form a trajectory (to tol) and are final, so each Newton solve re-solves X[:, p0:] from the
    final state X[:, p0 - 1]; p0 advances by at least one per solve (prefix exactness). A full Newton step
    (slopes clamped to |J| <= jac_clip when jac_clip > 0) is kept unless its residual is non-finite or grew more
    than `growth`-fold; then the step is redone with slopes clamped to [-1, 1], which cannot blow up. One host
    sync per Newton solve (plus one per rejected step)."""
    bsz, seqlen, dim = u.shape
    n = lam.shape[-1]
    X = torch.zeros(bsz, seqlen, dim, n, dtype=u.dtype, device=u.device)
    info = DeerInfo(iters=0, rejected=0, residual=float("inf"), converged=False, fallback=False)

    def evaluate(p0):
        xin = x0 if p0 == 0 else X[:, p0 - 1]
        Xp = _shift(X[:, p0:], xin, None if start is None else start[:, p0:])
        F, J, _, _ = _f_jac(Xp, u[:, p0:], lam, w)
        over, worst = _residual(X[:, p0:], F, tol)
        stats = torch.stack([over.any().to(worst.dtype), over.to(torch.int8).argmax().to(worst.dtype), worst]).tolist()
        return Xp, F, J, stats

    def solve(p0, Xp, F, J, clip):
        if clip > 0:
            J = J.clamp(-clip, clip)
        st = None if start is None else start[:, p0:]
        a = J.masked_fill(_known(st, bsz, seqlen - p0, u.device)[:, :, None, None], 0.0)
        X[:, p0:] = linear_scan(a, torch.addcmul(F, a, Xp, value=-1.0))

    p0 = 0
    Xp, F, J, stats = evaluate(p0)
    while True:
        info["residual"] = stats[2]
        if not stats[0]:
            info["converged"] = True
            return X, info
        if info["iters"] >= max_iters or not math.isfinite(stats[2]):
            break
        info["iters"] += 1
        first = int(stats[1])
        p0 += first
        Xp, F, J = Xp[:, first:], F[:, first:], J[:, first:]
        solve(p0, Xp, F, J, jac_clip)
        Xp2, F2, J2, stats2 = evaluate(p0)
        if jac_clip != 1.0 and not (stats2[2] <= growth * stats[2]):  # NaN/inf or grown: take the safe step
            info["rejected"] += 1
            solve(p0, Xp, F, J, 1.0)
            Xp2, F2, J2, stats2 = evaluate(p0)
        Xp, F, J, stats = Xp2, F2, J2, stats2
    p0 += int(stats[1])
    if math.isfinite(stats[2]):
        _warn_once("cap", "COFFEE DEER: no convergence within model.coffee.deer_max_iters=%d Newton solves (L=%d, "
                   "converged prefix %d): relative fixed-point residual max|x_k - f(x_(k-1))| / (1 + |x_k|) = %.3g; %s",
                   max_iters, seqlen, p0, stats[2],
                   "finishing the suffix with the sequential loop (exact)" if fallback
                   else "returning the last iterate (inexact): raise deer_max_iters (L solves are always exact)")
        if not fallback:
            return X, info
    else:
        _warn_once("nonfinite", "COFFEE DEER: non-finite iterate after %d Newton solves; finishing from position "
                   "%d with the sequential loop", info["iters"], p0)
    info["fallback"] = True
    xin = x0 if p0 == 0 else X[:, p0 - 1]
    st = None if start is None else start[:, p0:]
    X[:, p0:] = coffee_sequential(u[:, p0:], lam, w, xin, None if st is None else st.long().cumsum(1))
    return X, info


class _DeerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, lam, w, x0, start, tol, max_iters, jac_clip, fallback, info_out):
        X, info = _deer_solve(u, lam, w, x0, start, tol, max_iters, jac_clip, fallback)
        info_out.update(info)
        ctx.save_for_backward(u, lam, w, x0 if x0 is not None else u.new_zeros(0), X)
        ctx.has_x0 = x0 is not None
        ctx.start = start
        return X

    @staticmethod
    def backward(ctx, gX):
        u, lam, w, x0, X = ctx.saved_tensors
        x0 = x0 if ctx.has_x0 else None
        start = ctx.start
        bsz, seqlen = u.shape[:2]
        Xp = _shift(X, x0, start)
        _, J, g, s = _f_jac(Xp, u, lam, w)
        J = J.masked_fill(_known(start, bsz, seqlen, u.device)[:, :, None, None], 0.0)
        # G_k = gX_k + J_(k+1) G_(k+1): the slope of step k is the next position's Jacobian (0 past the end)
        Jn = torch.cat([J[:, 1:], torch.zeros_like(J[:, :1])], dim=1)
        G = linear_scan(Jn, gX.to(X.dtype), reverse=True)
        Gg = G * g
        gu = Gg.sum(-1) if ctx.needs_input_grad[0] else None
        glam = (Gg * Xp).sum((0, 1)) if ctx.needs_input_grad[1] else None
        gw = (Gg * (1.0 - g) * Xp * s).sum((0, 1)) if ctx.needs_input_grad[2] else None
        gx0 = None
        if ctx.has_x0 and ctx.needs_input_grad[3]:
            _, J0, _, _ = _f_jac(x0[:, None].to(X.dtype), u[:, :1], lam, w)  # slope of position 0 (never masked)
            gx0 = (J0[:, 0] * G[:, 0]).to(x0.dtype)
        cast = lambda t, ref: None if t is None else t.to(ref.dtype)  # noqa: E731
        return cast(gu, u), cast(glam, lam), cast(gw, w), gx0, None, None, None, None, None, None


def coffee_deer(u, lam, w, x0=None, seq_idx=None, tol: float = 1e-6, max_iters: int = 100,
                jac_clip: float = 0.0, fallback: bool = True):
    """Every state X [B, L, D, n] (compute dtype) by DEER Newton iterations, and a DeerInfo. Differentiable
    w.r.t. u, lam, w and x0 through the converged trajectory (adjoint recurrence; the iterations keep no
    graph). Stops when every |x_k - f(x_(k-1))| <= tol * (1 + |x_k|), or after
    max_iters Newton solves: then it warns once, naming the residual, and (fallback=True) finishes the
    unconverged suffix with the sequential loop, so the result is exact either way."""
    cdt = _cdt(u)
    info = DeerInfo()
    X = _DeerFn.apply(u.to(cdt), lam.to(cdt), w.to(cdt), None if x0 is None else x0.to(cdt),
                      doc_starts(seq_idx), float(tol), int(max_iters), float(jac_clip), bool(fallback), info)
    return X, info
