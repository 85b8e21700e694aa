"""B'MOJO layer (`B`): Zancato et al., "B'MOJO: Hybrid State Space Realizations of Foundation Models with
Eidetic and Fading Memory" (Alg. 1 in its chunked, parallel form of §3.3 / App. B.2).

    y      = Mamba2(u)                           the SSM (model.mamba.*): fading memory, y [B, L, d_model]
    eps_t  = mean_d (y_t - (1/k) sum_(i=1..k) y_(t-i))^2        innovation: error of a fixed running-average
                                                 predictor over the last k SSM outputs (no weights; no gradient)
    chunks of w tokens, counted from each document's start; chunk c's memory tokens, fixed for the chunk:
      fading   m_f SSM outputs just before the chunk, y_(cw-m_f) .. y_(cw-1)
      eidetic  the m_e tokens of the document before the chunk with the largest eps (ties: the earlier token),
               i.e. the running top-m_e "insert if eps beats the current minimum" of Alg. 1
    out_t  = o_proj(Attn(q(u_t); K/V = [last w raw tokens u_(t-w+1..t) | fading k/v(norm(y)) | eidetic k/v(u)]))
             + y_t                              (ssm_residual, the default; without it the SSM reaches the
                                                 output only through the fading tokens)

The window is w raw tokens (the query included) plus the m = m_f + m_e memory tokens of the query's chunk,
exactly what a causal sliding window of K = w + m over the interleaved [M_1, C_1, M_2, C_2, ...] sequence
of the paper sees. Keys and values of the raw and eidetic tokens come from the layer input u (an eidetic token
is a stored input), those of the fading tokens from the RMS-normed SSM output; the projections are shared.
There is no positional encoding (the paper's B'MOJO uses none); attention heads come from model.attn.*
(n_heads, n_kv_heads, head_dim, bias; rope and sliding_window are ignored here).

Computation: the SSM is the Mamba-2 mixer (kernels.ssd); attention is banded: queries in blocks of
Q = min(w, L) see the Q + w raw keys ending at their block plus every memory slot of the row (masked to their
chunk's), so the cost is O(L (Q + w + G m)) for G chunks in the row, not O(L^2).

State (BMojoState, models/state.py) for decoding and BPTT: the SSM state, the last w raw keys/values, the
current chunk's memory k/v, the top-m_e candidates (k/v, score, position), the last max(m_f, k) SSM outputs
and the in-document position. Documents (`seq_idx`) restart everything: SSM state, window, memory, chunking.

Tensor parallelism (`bmojo_tp_layout` below): the SSM is split like a Mamba-2 layer and its out_proj
all-reduces (the full y is needed on every rank: for the innovation scores, identical on every rank, so every
rank selects the same tokens, and for the fading tokens); the attention heads are split and o_proj is
row-parallel. Two all-reduces per layer forward (with sequence parallelism: all-gather in, one all-reduce,
reduce-scatter out).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megassm.config import ModelConfig, attn_dims

from .attention import attn_tp_layout, check_attn_section, doc_positions, masked_sdpa
from .init import make_linear
from .mamba2 import Mamba2Mixer, to_fp32, check_mamba_section, mamba2_activation_bytes, mamba2_flops, mamba2_tp_layout
from .norm import RMSNorm
from .registry import BlockKind, Cut, Replicate, TPLayout, causal_pairs, register
from .state import BMojoState, MambaState

__all__ = ["BMojoMixer", "select_top"]


def select_top(score: torch.Tensor, pos: torch.Tensor, eligible: torch.Tensor, m: int):
    """The m best entries along the last dim by (score descending, position ascending) among `eligible`.
    Returns (indices [..., m], valid [..., m]). A deterministic total order, so the running top-m of decoding
    and the prefix top-m of the forward pick the same tokens."""
    big = torch.iinfo(torch.int64).max
    o1 = torch.argsort(pos.masked_fill(~eligible, big), dim=-1, stable=True)
    s1 = score.float().masked_fill(~eligible, -math.inf).gather(-1, o1)
    o2 = torch.argsort(s1, dim=-1, descending=True, stable=True)
    idx = o1.gather(-1, o2)[..., :m]
    return idx, eligible.gather(-1, idx)


def _gather_kv(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t [B, Hkv, P, hd], idx [B, ...] -> [B, Hkv, ..., hd]."""
    b, h, _, d = t.shape
    flat = idx.reshape(b, 1, -1, 1).expand(b, h, -1, d)
    return t.gather(2, flat).reshape(b, h, *idx.shape[1:], d)


class BMojoMixer(nn.Module):
    stateful = True  # carries a recurrent state (models/state.py)

    def __init__(self, cfg: ModelConfig, n_layer: int):
        super().__init__()
        b, a = cfg.bmojo, cfg.attn
        dims = attn_dims(cfg)
        self.d_model = cfg.d_model
        self.n_heads, self.n_kv_heads, self.head_dim = dims["n_heads"], dims["n_kv_heads"], dims["head_dim"]
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"B'MOJO: n_kv_heads {self.n_kv_heads} must divide n_heads {self.n_heads}")
        self.window = b.window
        self.n_fading = b.n_fading
        self.n_eidetic = b.n_eidetic
        self.pred_k = b.predictor_width
        self.ssm_residual = b.ssm_residual
        self.n_hist = max(b.n_fading, b.predictor_width)
        self.ssm = Mamba2Mixer(cfg, n_layer)
        std = cfg.init_std
        d = cfg.d_model
        self.fade_norm = RMSNorm(d, cfg.norm_eps)
        self.q_proj = make_linear(d, self.n_heads * self.head_dim, a.bias, std)
        self.k_proj = make_linear(d, self.n_kv_heads * self.head_dim, a.bias, std)
        self.v_proj = make_linear(d, self.n_kv_heads * self.head_dim, a.bias, std)
        self.o_proj = make_linear(self.n_heads * self.head_dim, d, a.bias, std / math.sqrt(2 * n_layer))

    def extra_repr(self) -> str:
        return (f"window={self.window}, n_fading={self.n_fading}, n_eidetic={self.n_eidetic}, "
                f"predictor_width={self.pred_k}, ssm_residual={self.ssm_residual}, heads={self.n_heads}/{self.n_kv_heads}x{self.head_dim}")

    # hooks for the tensor-parallel plan
    def fading_in(self, y: torch.Tensor) -> torch.Tensor:
        """y entering the (column-parallel) fading k/v projections."""
        return y

    def residual_y(self, y: torch.Tensor) -> torch.Tensor:
        """The part of y added to this rank's output (all of it here; its sequence shard under SP)."""
        return y

    # ------------------------------------------------------------------------------------------------
    def allocate_state(self, batch_size: int, device=None, dtype=torch.float32) -> BMojoState:
        ms = self.ssm.allocate_state(batch_size, device=device)
        B, Hkv, hd, W = batch_size, self.n_kv_heads, self.head_dim, self.window
        m, me = self.n_fading + self.n_eidetic, self.n_eidetic
        z = lambda *s: torch.zeros(*s, device=device, dtype=dtype)  # noqa: E731
        f = lambda *s: torch.zeros(*s, device=device, dtype=torch.bool)  # noqa: E731
        return BMojoState(
            conv=ms.conv, ssm=ms.ssm,
            k=z(B, Hkv, W, hd), v=z(B, Hkv, W, hd), valid=f(B, W),
            mem_k=z(B, Hkv, m, hd), mem_v=z(B, Hkv, m, hd), mem_valid=f(B, m),
            cand_k=z(B, Hkv, me, hd), cand_v=z(B, Hkv, me, hd),
            cand_score=torch.zeros(B, me, device=device, dtype=torch.float32),
            cand_pos=torch.zeros(B, me, device=device, dtype=torch.long), cand_valid=f(B, me),
            y_hist=torch.zeros(B, self.n_hist, self.d_model, device=device, dtype=torch.float32),
            y_valid=f(B, self.n_hist),
            pos=torch.zeros(B, device=device, dtype=torch.long),
        )

    def _kv(self, x: torch.Tensor):
        """x [..., d_model] -> k, v [..., n_kv_heads, head_dim]."""
        lead = x.shape[:-1]
        return (self.k_proj(x).view(*lead, self.n_kv_heads, self.head_dim),
                self.v_proj(x).view(*lead, self.n_kv_heads, self.head_dim))

    def _fading_kv(self, y: torch.Tensor):
        return self._kv(self.fade_norm(self.fading_in(y)))

    def _sdpa(self, q, k, v, mask):
        return masked_sdpa(q, k, v, mask, enable_gqa=self.n_heads != self.n_kv_heads)

    @staticmethod
    @torch.no_grad()
    def _scores(yc: torch.Tensor, yvalid: torch.Tensor, ydoc: torch.Tensor, k: int, hist: int) -> torch.Tensor:
        """Innovation eps of the tokens at combined indices hist.. of yc [B, hist + L, d] (fp32): mean square
        error of the running average of the previous k outputs of the same document (missing ones count 0)."""
        L = yc.shape[1] - hist
        cur = yc[:, hist:]
        pred = torch.zeros_like(cur)
        for i in range(1, k + 1):
            ok = yvalid[:, hist - i:hist - i + L] & (ydoc[:, hist - i:hist - i + L] == ydoc[:, hist:])
            pred = pred + yc[:, hist - i:hist - i + L] * ok[..., None]
        return (cur - pred / k).pow(2).mean(-1)

    # ------------------------------------------------------------------------------------------------
    def forward(
        self,
        u: torch.Tensor,
        seq_idx: torch.Tensor | None = None,
        state: BMojoState | None = None,
        return_state: bool = False,
    ) -> tuple[torch.Tensor, BMojoState | None]:
        """u [B, L, d_model]; seq_idx [B, L] document ids; state carried into the first document of each row.
        Returns (out [B, L, d_model], final state or None)."""
        bsz, L, _ = u.shape
        dev = u.device
        W, mf, me, Hy = self.window, self.n_fading, self.n_eidetic, self.n_hist
        m = mf + me
        ssm_in = None if state is None else MambaState(conv=state.conv, ssm=state.ssm)
        y, ssm_state = self.ssm(u, seq_idx=seq_idx, state=ssm_in, return_state=return_state)
        if state is None:
            state = self.allocate_state(bsz, device=dev)
        sid = torch.zeros(bsz, L, dtype=torch.int32, device=dev) if seq_idx is None else seq_idx
        sid0 = sid[:, :1]
        pos = doc_positions(seq_idx, state.pos, bsz, L, dev)  # in-document positions [B, L]
        t_idx = torch.arange(L, device=dev)

        # SSM outputs with the carried history in front: combined index Hy + t is token t
        yc = torch.cat([state.y_hist.to(y.dtype), y], dim=1)
        yvalid = torch.cat([state.y_valid, torch.ones(bsz, L, dtype=torch.bool, device=dev)], dim=1)
        ydoc = torch.cat([sid0.expand(bsz, Hy), sid], dim=1)
        eps = self._scores(yc.detach().float(), yvalid, ydoc, self.pred_k, Hy)  # [B, L] fp32

        # groups: maximal runs of one (document, chunk); their memory is fixed
        chunk = torch.div(pos, W, rounding_mode="floor")
        new = torch.ones(bsz, L, dtype=torch.bool, device=dev)
        new[:, 1:] = (sid[:, 1:] != sid[:, :-1]) | (chunk[:, 1:] != chunk[:, :-1])
        grp = new.long().cumsum(1) - 1  # [B, L]
        if seq_idx is None:
            # no resets: a row spans at most ceil(L / W) + 1 chunks (its first one may continue the carried
            # state's). A static count (groups past a row's last are empty and masked) keeps the forward free
            # of host reads, so it can be captured in a CUDA graph.
            G = -(-L // W) + 1
        else:
            G = int(grp[:, -1].max()) + 1  # documents make the count data-dependent: read it on the host
        s_g = torch.full((bsz, G), L, dtype=torch.long, device=dev).scatter_reduce(
            1, grp, t_idx.expand(bsz, L), reduce="amin")  # first token of each group (L: padding group)
        g_ok = s_g < L
        s_c = s_g.clamp(max=L - 1)
        doc_g, pos_g = sid.gather(1, s_c), pos.gather(1, s_c)
        cont = (s_g == 0) & (pos_g % W != 0)  # continues the carried state's chunk: its memory is the state's

        q = self.q_proj(u).view(bsz, L, self.n_heads, self.head_dim)
        k, v = self._kv(u)  # [B, L, Hkv, hd]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, hd]

        # memory of every group: [fading | eidetic] slots
        mem_k, mem_v, mem_ok = [], [], []
        if mf:
            fi = Hy + s_c[:, :, None] - mf + torch.arange(mf, device=dev)  # [B, G, mf] combined indices
            fflat = fi.flatten(1)
            fok = yvalid.gather(1, fflat).view_as(fi) & (ydoc.gather(1, fflat).view_as(fi) == doc_g[..., None])
            fy = yc.gather(1, fflat[..., None].expand(-1, -1, self.d_model))  # [B, G*mf, d]
            fk, fv = self._fading_kv(fy)  # [B, G*mf, Hkv, hd]
            mem_k.append(fk.transpose(1, 2).reshape(bsz, self.n_kv_heads, G, mf, self.head_dim))
            mem_v.append(fv.transpose(1, 2).reshape(bsz, self.n_kv_heads, G, mf, self.head_dim))
            mem_ok.append(fok)
        if me:
            p_score = torch.cat([state.cand_score, eps], dim=1)  # pool: carried candidates, then this window
            p_pos = torch.cat([state.cand_pos, pos], dim=1)
            p_doc = torch.cat([sid0.expand(bsz, me), sid], dim=1)
            p_ok = torch.cat([state.cand_valid, torch.ones(bsz, L, dtype=torch.bool, device=dev)], dim=1)
            elig = p_ok[:, None] & (p_doc[:, None] == doc_g[..., None]) & (p_pos[:, None] < pos_g[..., None])
            P = me + L
            idx, eok = select_top(p_score[:, None].expand(bsz, G, P), p_pos[:, None].expand(bsz, G, P), elig, me)
            pk = torch.cat([state.cand_k.to(k.dtype), k], dim=2)
            pv = torch.cat([state.cand_v.to(v.dtype), v], dim=2)
            mem_k.append(_gather_kv(pk, idx))
            mem_v.append(_gather_kv(pv, idx))
            mem_ok.append(eok)
        if m:
            mk = torch.cat([t.to(k.dtype) for t in mem_k], dim=3)  # [B, Hkv, G, m, hd]
            mv = torch.cat([t.to(v.dtype) for t in mem_v], dim=3)
            mok = torch.cat(mem_ok, dim=2) & g_ok[..., None]  # [B, G, m]
            c0 = cont[:, 0]  # the first group may continue the carried chunk (no host test: graph-safe)
            sel = c0.view(bsz, 1, 1, 1)
            mk = torch.cat([torch.where(sel, state.mem_k.to(mk.dtype), mk[:, :, 0]).unsqueeze(2), mk[:, :, 1:]], 2)
            mv = torch.cat([torch.where(sel, state.mem_v.to(mv.dtype), mv[:, :, 0]).unsqueeze(2), mv[:, :, 1:]], 2)
            mok = torch.cat([torch.where(c0[:, None], state.mem_valid, mok[:, 0]).unsqueeze(1), mok[:, 1:]], 1)

        # banded attention: query block i (rows iQ .. iQ+Q-1) sees raw keys at combined index iQ .. iQ+Q+W-1
        # (combined index r = token r - W; the first W are the carried window) and all memory slots (masked)
        Q = min(W, L)
        nblk = -(-L // Q)
        pad = nblk * Q - L
        rk = torch.cat([state.k.to(k.dtype), k], dim=2)
        rv = torch.cat([state.v.to(v.dtype), v], dim=2)
        r_ok = torch.cat([state.valid, torch.ones(bsz, L, dtype=torch.bool, device=dev)], dim=1)
        r_doc = torch.cat([sid0.expand(bsz, W), sid], dim=1)
        if pad:
            rk_p, rv_p = F.pad(rk, (0, 0, 0, pad)), F.pad(rv, (0, 0, 0, pad))
            r_ok_p = F.pad(r_ok, (0, pad), value=False)
            r_doc_p = F.pad(r_doc, (0, pad), value=-1)
            q = F.pad(q, (0, 0, 0, 0, 0, pad))
            q_doc = F.pad(sid, (0, pad), value=-2)
            q_grp = F.pad(grp, (0, pad), value=-1)
        else:
            rk_p, rv_p, r_ok_p, r_doc_p, q_doc, q_grp = rk, rv, r_ok, r_doc, sid, grp
        span = Q + W
        kb = rk_p.unfold(2, span, Q).permute(0, 2, 1, 4, 3)  # [B, nblk, Hkv, span, hd]
        vb = rv_p.unfold(2, span, Q).permute(0, 2, 1, 4, 3)
        okb = r_ok_p.unfold(1, span, Q)  # [B, nblk, span]
        docb = r_doc_p.unfold(1, span, Q)
        qd = q_doc.view(bsz, nblk, Q)
        qq = torch.arange(Q, device=dev)[:, None]
        jj = torch.arange(span, device=dev)[None, :]
        band = (jj > qq) & (jj <= qq + W)  # 0 <= query - key < W
        mask = band & okb[:, :, None, :] & (docb[:, :, None, :] == qd[..., None])  # [B, nblk, Q, span]
        if pad:  # padded queries look at their own (empty) slot: no fully masked row, output discarded
            padq = (torch.arange(nblk * Q, device=dev) >= L).view(1, nblk, Q, 1)
            mask = mask | (padq & (jj == qq + W))
        if m:
            slot_grp = torch.arange(G, device=dev).repeat_interleave(m)  # [G*m]
            mmask = (q_grp.view(bsz, nblk, Q, 1) == slot_grp) & mok.reshape(bsz, 1, 1, G * m)
            mask = torch.cat([mask, mmask], dim=-1)
            kb = torch.cat([kb, mk.reshape(bsz, 1, self.n_kv_heads, G * m, -1).expand(-1, nblk, -1, -1, -1)], 3)
            vb = torch.cat([vb, mv.reshape(bsz, 1, self.n_kv_heads, G * m, -1).expand(-1, nblk, -1, -1, -1)], 3)
        S = kb.shape[3]
        qb = q.view(bsz, nblk, Q, self.n_heads, self.head_dim).permute(0, 1, 3, 2, 4)
        o = self._sdpa(qb.reshape(bsz * nblk, self.n_heads, Q, self.head_dim),
                       kb.reshape(bsz * nblk, self.n_kv_heads, S, self.head_dim),
                       vb.reshape(bsz * nblk, self.n_kv_heads, S, self.head_dim),
                       mask.reshape(bsz * nblk, 1, Q, S))
        o = o.view(bsz, nblk, self.n_heads, Q, self.head_dim).permute(0, 1, 3, 2, 4).reshape(bsz, nblk * Q, -1)
        out = self.o_proj(o[:, :L])
        if self.ssm_residual:
            out = out + self.residual_y(y)

        if not return_state:
            return out, None
        last = sid[:, -1:]
        keep_ok = r_ok[:, L:] & (r_doc[:, L:] == last)
        hist_ok = yvalid[:, L:] & (ydoc[:, L:] == last)
        new = dict(conv=ssm_state.conv, ssm=ssm_state.ssm, k=rk[:, :, L:], v=rv[:, :, L:], valid=keep_ok,
                   y_hist=to_fp32(yc[:, L:]), y_valid=hist_ok, pos=pos[:, -1] + 1)
        g_last = grp[:, -1]
        if m:
            gi = g_last.view(bsz, 1, 1, 1, 1).expand(-1, self.n_kv_heads, 1, m, self.head_dim)
            new.update(mem_k=mk.gather(2, gi)[:, :, 0], mem_v=mv.gather(2, gi)[:, :, 0],
                       mem_valid=mok.gather(1, g_last.view(bsz, 1, 1).expand(-1, 1, m))[:, 0])
        else:
            new.update(mem_k=state.mem_k, mem_v=state.mem_v, mem_valid=state.mem_valid)
        if me:
            elig = p_ok & (p_doc == last)
            idx, cok = select_top(p_score, p_pos, elig, me)
            new.update(cand_k=_gather_kv(pk, idx), cand_v=_gather_kv(pv, idx), cand_score=p_score.gather(1, idx),
                       cand_pos=p_pos.gather(1, idx), cand_valid=cok)
        else:
            new.update(cand_k=state.cand_k, cand_v=state.cand_v, cand_score=state.cand_score,
                       cand_pos=state.cand_pos, cand_valid=state.cand_valid)
        return out, BMojoState(**new)

    # ------------------------------------------------------------------------------------------------
    def step(self, u: torch.Tensor, state: BMojoState) -> tuple[torch.Tensor, BMojoState]:
        """One token: u [B, d_model] -> (out [B, d_model], new state). Resets are applied by the caller."""
        bsz = u.shape[0]
        dev = u.device
        W, mf, me = self.window, self.n_fading, self.n_eidetic
        m = mf + me
        y, ms = self.ssm.step(u, MambaState(conv=state.conv, ssm=state.ssm))
        with torch.no_grad():  # innovation of this token (n_hist >= pred_k, missing outputs are 0)
            yh = state.y_hist[:, -self.pred_k:] * state.y_valid[:, -self.pred_k:, None]
            eps = (y.detach().float() - yh.sum(1) / self.pred_k).pow(2).mean(-1)  # [B]

        q = self.q_proj(u).view(bsz, self.n_heads, 1, self.head_dim)
        k, v = self._kv(u)  # [B, Hkv, hd]
        k, v = k[:, :, None], v[:, :, None]

        # memory: republished at a chunk start (position 0 of a document included: then it is empty)
        publish = (state.pos % W == 0)
        mem_k, mem_v, mem_ok = state.mem_k.to(k.dtype), state.mem_v.to(v.dtype), state.mem_valid
        if m and bool(publish.any()):
            nk, nv, nok = [], [], []
            if mf:
                fk, fv = self._fading_kv(state.y_hist[:, -mf:].to(y.dtype))  # [B, mf, Hkv, hd]
                nk.append(fk.transpose(1, 2))
                nv.append(fv.transpose(1, 2))
                nok.append(state.y_valid[:, -mf:])
            if me:
                nk.append(state.cand_k.to(k.dtype))
                nv.append(state.cand_v.to(v.dtype))
                nok.append(state.cand_valid)
            sel = publish.view(bsz, 1, 1, 1)
            mem_k = torch.where(sel, torch.cat(nk, 2).to(k.dtype), mem_k)
            mem_v = torch.where(sel, torch.cat(nv, 2).to(v.dtype), mem_v)
            mem_ok = torch.where(publish[:, None], torch.cat(nok, 1), mem_ok)

        rk = torch.cat([state.k.to(k.dtype), k], dim=2)[:, :, 1:]  # the last W tokens, this one included
        rv = torch.cat([state.v.to(v.dtype), v], dim=2)[:, :, 1:]
        r_ok = torch.cat([state.valid, torch.ones(bsz, 1, dtype=torch.bool, device=dev)], dim=1)[:, 1:]
        keys, vals, ok = torch.cat([rk, mem_k], 2), torch.cat([rv, mem_v], 2), torch.cat([r_ok, mem_ok], 1)
        o = self._sdpa(q, keys, vals, ok[:, None, None, :])
        out = self.o_proj(o.reshape(bsz, self.n_heads * self.head_dim))
        if self.ssm_residual:
            out = out + y

        if me:  # this token joins the candidates (running top-m_e)
            p_score = torch.cat([state.cand_score, eps[:, None]], dim=1)
            p_pos = torch.cat([state.cand_pos, state.pos[:, None]], dim=1)
            p_ok = torch.cat([state.cand_valid, torch.ones(bsz, 1, dtype=torch.bool, device=dev)], dim=1)
            idx, cok = select_top(p_score, p_pos, p_ok, me)
            pk = torch.cat([state.cand_k.to(k.dtype), k], dim=2)
            pv = torch.cat([state.cand_v.to(v.dtype), v], dim=2)
            cand = dict(cand_k=_gather_kv(pk, idx), cand_v=_gather_kv(pv, idx), cand_score=p_score.gather(1, idx),
                        cand_pos=p_pos.gather(1, idx), cand_valid=cok)
        else:
            cand = dict(cand_k=state.cand_k, cand_v=state.cand_v, cand_score=state.cand_score,
                        cand_pos=state.cand_pos, cand_valid=state.cand_valid)
        new = BMojoState(
            conv=ms.conv, ssm=ms.ssm, k=rk, v=rv, valid=r_ok, mem_k=mem_k, mem_v=mem_v, mem_valid=mem_ok,
            y_hist=torch.cat([state.y_hist[:, 1:], to_fp32(y)[:, None].to(state.y_hist.dtype)], dim=1),
            y_valid=torch.cat([state.y_valid[:, 1:], torch.ones(bsz, 1, dtype=torch.bool, device=dev)], dim=1),
            pos=state.pos + 1, **cand,
        )
        return out, new


# ----------------------------------------------------------------------------------------------------
# the block kind `B`
# ----------------------------------------------------------------------------------------------------
def _check(cfg, need) -> None:
    check_mamba_section(cfg, need)  # its SSM is a Mamba-2 mixer configured by model.mamba.*
    check_attn_section(cfg, need, rope=False)  # its attention takes its heads from model.attn.*
    b = cfg.model.bmojo
    need(b.window >= 1, f"model.bmojo.window must be >= 1, got {b.window}")
    need(b.n_fading >= 0, f"model.bmojo.n_fading must be >= 0, got {b.n_fading}")
    need(b.n_eidetic >= 0, f"model.bmojo.n_eidetic must be >= 0, got {b.n_eidetic}")
    need(b.predictor_width >= 1, f"model.bmojo.predictor_width must be >= 1, got {b.predictor_width}")


def bmojo_flops(m: ModelConfig, L: int) -> dict:
    """Its Mamba-2 SSM (every term of `M`), and its attention: q/k/v/o on the L tokens, k/v on the n_fading
    SSM outputs of each of the ceil(L / w) chunks, scores over the w-token window (causal_pairs(L, w)) plus
    the m_f + m_e memory tokens of every query past the first chunk."""
    b = m.bmojo
    a = attn_dims(m)
    d, nh, nkv, hd = m.d_model, a["n_heads"], a["n_kv_heads"], a["head_dim"]
    W, mem = b.window, b.n_fading + b.n_eidetic
    n_fade = -(-L // W) * b.n_fading
    proj = 2 * L * d * (nh * hd + 2 * nkv * hd) + 2 * L * nh * hd * d + 2 * n_fade * d * 2 * nkv * hd
    pairs = causal_pairs(L, W) + max(L - W, 0) * mem
    return {"bmojo_ssm": sum(mamba2_flops(m, L).values()), "bmojo_attn": proj + 2 * 2 * hd * nh * pairs}


def bmojo_activation_bytes(m, a: int, ctx) -> tuple[int, int]:
    """Rough (not measured): the SSM plus attention over window + memory tokens, its mask."""
    local, stream = mamba2_activation_bytes(m.ssm, a)
    hq, hkv, hd = m.n_heads, m.n_kv_heads, m.head_dim
    local += a * (2 * hq * hd + 2 * hkv * hd + hq * hd + ctx.cfg.d_model) + a * (m.window + m.n_fading + m.n_eidetic)
    return local, stream


def bmojo_tp_layout(mixer, ranks: int, sp: bool) -> TPLayout:
    """The SSM as a Mamba-2 layer whose out_proj all-reduces (never reduce-scatters: y is needed for every
    token on every rank, for the innovation scores -- identical on every rank, so every rank selects the same
    eidetic tokens -- and the fading tokens); the attention heads split, o_proj row-parallel. Two all-reduces
    per layer forward (SP: all-gather in, one all-reduce, reduce-scatter out). The `bmojo` variant feeds the
    full y to the column-parallel fading projections."""
    lay = TPLayout().merge(mamba2_tp_layout(mixer.ssm, ranks, False), "ssm.")
    lay.merge(attn_tp_layout(mixer, ranks, sp), "")
    lay.params["fade_norm.weight"] = Cut(0, (Replicate(mixer.d_model, 1, partial=True),))
    lay.variants[""] = ("bmojo", {"sp": sp})
    return lay


BLOCK_KIND = register(BlockKind(
    letter="B", name="B'MOJO", mixer=BMojoMixer, sections=("mamba", "attn", "bmojo"), state=BMojoState,
    check=_check, flop_keys=("bmojo_ssm", "bmojo_attn"), flops=bmojo_flops,
    activation_bytes=bmojo_activation_bytes, tp_layout=bmojo_tp_layout, cp=None, bptt=None,
    cuda_graph="without_resets",
))
