"""COFFEE mixer (`C`): Zattra et al., "Context-Selective State Space Models: Feedback is All You Need" (eq. 7).

D channels, each with n states and no mixing between them (lam, w, C: [D, n]):

    v      = in_proj(u)                                 d_model -> D (model.coffee.proj; else v = u, D = d_model)
    g_k    = sigmoid(w * x_(k-1))                       the step size is fed back from the state, not the input
    x_k    = x_(k-1) + g_k * (lam * x_(k-1) + v_k)      x [B, D, n], fp32, x_(-1) = carried state (or 0)
    y_k    = sum_j C_j * x_k,j   (* sigmoid(sum_j w_out_j * x_k,j) with the "+OF" output filter)
    out    = out_proj(y)                                D -> d_model

lam = -2 sigmoid(raw) in (-2, 0) (lam_param=bounded: |1 + lam g| <= 1, the stability the paper asks for but
does not say how it enforces) or lam = raw (lam_param=free, the paper's A = 0 init). The recurrence is not
linear in x, so it has no chunked form; training solves it in parallel with DEER Newton iterations (a linear
scan per iteration, exact at convergence, gradients by the adjoint recurrence: kernels/coffee/reference.py), or
token by token (solver=sequential: `kernels.coffee_scan`, one Triton kernel with the read-out fused on the GPU,
the plain loop on CPU). Decoding is the one-token step. The number of Newton solves of
the last forward is `mixer.last_info["iters"]` (`deer_stats(model)` collects them for logging).

Tensor parallelism (`coffee_tp_layout` below): channels are independent, so in_proj is column-parallel,
lam / w / C / w_out are sharded by channel, out_proj is row-parallel: one all-reduce per layer forward, none
inside the recurrence (each rank runs its own Newton iterations on its channels).

Also here: the paper's bare induction-head model (`CoffeeCore`: embedding -> one COFFEE layer -> distances to
the embeddings) and the 6-parameter toy of its Figure 2 (`ih0_toy`, `IH0_SEQUENCES`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megassm.config import ModelConfig
from megassm import kernels as K
from megassm.kernels.coffee.reference import coffee_deer, coffee_readout, coffee_sequential, coffee_step

from .init import InitRule, make_linear
from .registry import BlockKind, Cut, Split, TPLayout, register
from .state import CoffeeState

__all__ = ["CoffeeMixer", "CoffeeCore", "distance_logits", "ih0_toy", "ih0_final_states", "IH0_SEQUENCES",
           "IH0_INIT", "IH0_LEARNED", "deer_stats"]


class CoffeeMixer(nn.Module):
    stateful = True  # carries a recurrent state (models/state.py)

    def __init__(self, cfg: ModelConfig, n_layer: int):
        super().__init__()
        c = cfg.coffee
        self.d_model = cfg.d_model
        self.d_state = c.d_state
        self.proj = c.proj
        self.channels = c.expand * cfg.d_model if c.proj else cfg.d_model
        self.lam_param = c.lam_param
        self.output_filter = c.output_filter
        self.solver = c.solver
        self.deer = dict(tol=c.deer_tol, max_iters=c.deer_max_iters, jac_clip=c.deer_jac_clip, fallback=c.deer_fallback)
        D, n = self.channels, c.d_state
        std = cfg.init_std
        self.in_proj = make_linear(cfg.d_model, D, False, std) if c.proj else None
        self.lam = nn.Parameter(torch.empty(D, n, dtype=torch.float32))
        self.w = nn.Parameter(torch.empty(D, n, dtype=torch.float32))
        self.C = nn.Parameter(torch.empty(D, n, dtype=torch.float32))
        self.w_out = nn.Parameter(torch.empty(D, n, dtype=torch.float32)) if c.output_filter else None
        self.out_proj = make_linear(D, cfg.d_model, False, std / math.sqrt(2 * n_layer)) if c.proj else None
        lo, hi = c.lam_init
        lam_rule = (InitRule("uniform", low=lo, high=hi, no_wd=True) if c.lam_param == "free"
                    else InitRule("logit_uniform", low=-hi / 2, high=-lo / 2, no_wd=True))  # lam = -2 sigmoid(raw)
        self.init_rules = {
            "lam": lam_rule,
            "w": InitRule("normal", std=c.w_init_std, no_wd=True),
            "C": InitRule("normal", std=c.c_init_std, no_wd=True),
            "w_out": InitRule("normal", std=c.w_init_std, no_wd=True),
        }
        self.last_info: dict = {}

    def extra_repr(self) -> str:
        return (f"channels={self.lam.shape[0]}, d_state={self.d_state}, lam={self.lam_param}, solver={self.solver}, "
                f"output_filter={self.output_filter}")

    def allocate_state(self, batch_size: int, device=None) -> CoffeeState:
        return CoffeeState(x=torch.zeros(batch_size, self.lam.shape[0], self.d_state, device=device,
                                         dtype=torch.float32))

    def lam_value(self) -> torch.Tensor:
        """lam [D, n] (fp32 at least)."""
        raw = self.lam.to(torch.promote_types(self.lam.dtype, torch.float32))
        return raw if self.lam_param == "free" else -2.0 * torch.sigmoid(raw)

    def readout(self, X: torch.Tensor) -> torch.Tensor:
        """y [..., D] from the states X [..., D, n]."""
        return coffee_readout(X, self.C, self.w_out)

    def forward(
        self,
        u: torch.Tensor,
        seq_idx: torch.Tensor | None = None,
        state: CoffeeState | None = None,
        return_state: bool = False,
    ) -> tuple[torch.Tensor, CoffeeState | None]:
        """u [B, L, d_model]; seq_idx [B, L] document ids (the state restarts from 0 at each change); state:
        carried into the first document of each row. Returns (out [B, L, d_model], final state or None)."""
        v = self.in_proj(u) if self.in_proj is not None else u
        x0 = None if state is None else state.x
        solver = self.solver if self.solver != "auto" else ("sequential" if v.is_cuda else "deer")
        if solver == "deer":
            X, info = coffee_deer(v, self.lam_value(), self.w, x0, seq_idx, **self.deer)
            self.last_info = dict(info)
            y, fin = self.readout(X), X[:, -1]
        else:  # the token loop with its read-out fused (one Triton kernel on the GPU; the reference loop on CPU)
            y, fin = K.coffee_scan(v, self.lam_value(), self.w, self.C, self.w_out, x0, seq_idx)
            self.last_info = {"iters": 0, "sequential": True}
        out = self.out_proj(y) if self.out_proj is not None else y.to(u.dtype)
        new_state = CoffeeState(x=fin.float() if fin.dtype != torch.float64 else fin) if return_state else None
        return out, new_state

    def step(self, u: torch.Tensor, state: CoffeeState) -> tuple[torch.Tensor, CoffeeState]:
        """One token: u [B, d_model] -> (out [B, d_model], new state). Resets are applied by the caller."""
        v = self.in_proj(u) if self.in_proj is not None else u
        x = coffee_step(state.x, v, self.lam_value(), self.w)
        y = self.readout(x)
        out = self.out_proj(y) if self.out_proj is not None else y.to(u.dtype)
        return out, CoffeeState(x=x if x.dtype == torch.float64 else x.float())


def deer_stats(model: nn.Module) -> dict:
    """DEER solver statistics of the last forward, for logging: {"coffee/deer_iters_max": ..,
    "coffee/deer_iters_mean": .., "coffee/deer_fallbacks": ..} (empty when no COFFEE layer ran DEER)."""
    infos = [m.last_info for m in model.modules()
             if isinstance(m, CoffeeMixer) and m.last_info and not m.last_info.get("sequential")]
    if not infos:
        return {}
    iters = [i.get("iters", 0) for i in infos]
    return {"coffee/deer_iters_max": max(iters), "coffee/deer_iters_mean": sum(iters) / len(iters),
            "coffee/deer_fallbacks": sum(bool(i.get("fallback")) for i in infos)}


# --------------------------------------------------------------------------------------------------------
# the paper's own model: induction heads (App. F, H) and the IH0 toy of Figure 2 (App. G)
# --------------------------------------------------------------------------------------------------------
def distance_logits(y: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """The paper's readout (App. F): p = softmin over symbols of the Euclidean distance from y [..., D] to each
    embedding row emb [M, D], then logit(p) = log p - log(1 - p) elementwise, in log space (stable as p -> 1).
    These "logits" go into cross-entropy; argmax = the nearest embedding."""
    dist = torch.cdist(y.reshape(-1, y.shape[-1]), emb.to(y.dtype)).reshape(*y.shape[:-1], emb.shape[0])
    logp = torch.log_softmax(-dist, dim=-1)
    return logp - torch.log(-torch.expm1(logp).clamp(max=-torch.finfo(logp.dtype).tiny))


class CoffeeCore(nn.Module):
    """The paper's bare one-layer model: tokens -> embedding (n_symbols x D) -> COFFEE (lam, w, C [D, n], no
    projections, norm or residual) -> distance_logits against the same embeddings. 3nD + n_symbols*D parameters
    (+ nD with output_filter): the Table 1 setting (n=8, D=16, 8 symbols) has 512. Init (App. H.2): lam = 0,
    C ~ N(0, 1), w ~ N(0, 1), embeddings = orthonormal rows of the QR of a U[0, 1) matrix (needs D >= n_symbols;
    N(0, 1) otherwise, which the paper leaves unspecified)."""

    def __init__(self, n_symbols: int, d: int, n: int, output_filter: bool = False, solver: str = "sequential",
                 seed: int = 0, deer: dict | None = None):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        if d >= n_symbols:
            q, _ = torch.linalg.qr(torch.rand(d, n_symbols, generator=gen))
            emb = q.T.contiguous()
        else:
            emb = torch.randn(n_symbols, d, generator=gen)
        self.embedding = nn.Parameter(emb)
        self.lam = nn.Parameter(torch.zeros(d, n))
        self.C = nn.Parameter(torch.randn(d, n, generator=gen))
        self.w = nn.Parameter(torch.randn(d, n, generator=gen))
        self.w_out = nn.Parameter(torch.randn(d, n, generator=gen)) if output_filter else None
        self.solver = solver
        self.deer = deer or {}
        self.last_info: dict = {}

    def states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Every state X [B, L, D, n] (x_(-1) = 0)."""
        u = self.embedding[tokens]
        if self.solver == "deer":
            X, info = coffee_deer(u, self.lam, self.w, **self.deer)
            self.last_info = dict(info)
            return X
        return coffee_sequential(u, self.lam, self.w)

    def outputs(self, tokens: torch.Tensor) -> torch.Tensor:
        return coffee_readout(self.states(tokens), self.C, self.w_out)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, L] in [0, n_symbols) -> distance logits [B, L, n_symbols]."""
        return distance_logits(self.outputs(tokens), self.embedding)


# IH0 (App. G): symbols 1, 2, 3 (1 = trigger), L = 4, D = 2, n = 1, lam = 0, C = 1, w = 1 fixed; only the six
# embedding numbers learn. Token ids here are symbol - 1.
IH0_INIT = ((6.0, 6.0), (-10.0, -1.0), (-1.0, -10.0))
IH0_LEARNED = ((5.394, 5.343), (-10.264, -1.575), (-1.539, -10.340))
# trigger|target|noise|trigger and noise|trigger|target|trigger, target and noise in {2, 3}: (symbols, target)
IH0_SEQUENCES = tuple(
    (seq, tgt)
    for tgt in (2, 3)
    for noise in (2, 3)
    for seq in ((1, tgt, noise, 1), (noise, 1, tgt, 1))
)


def ih0_toy(embeddings=IH0_LEARNED) -> CoffeeCore:
    """The 6-parameter model of Figure 2: CoffeeCore(3 symbols, D=2, n=1) with lam=0, C=1, w=1 frozen and the
    given embeddings (IH0_INIT to train from the paper's start, IH0_LEARNED for its solution) trainable."""
    m = CoffeeCore(3, 2, 1)
    with torch.no_grad():
        m.embedding.copy_(torch.tensor(embeddings, dtype=torch.float32))
        m.lam.zero_()
        m.C.fill_(1.0)
        m.w.fill_(1.0)
    for p in (m.lam, m.C, m.w):
        p.requires_grad_(False)
    return m


@torch.no_grad()
def ih0_final_states(model: CoffeeCore) -> dict:
    """{symbols (tuple): (final output y_3 as a tuple, predicted symbol, target)} for the 8 IH0 sequences; the
    prediction is the nearest embedding (symbol = row + 1). Figure 2: 1|2|3|1 -> (-6.92, -6.73) and
    3|1|2|1 -> (-6.41, -5.11), both predicting 2."""
    seqs = torch.tensor([s for s, _ in IH0_SEQUENCES]) - 1
    y = model.outputs(seqs)[:, -1]  # [8, D]
    pred = distance_logits(y, model.embedding).argmax(-1) + 1
    return {s: (tuple(round(float(v), 4) for v in y[i]), int(pred[i]), t) for i, (s, t) in enumerate(IH0_SEQUENCES)}


# ----------------------------------------------------------------------------------------------------
# the block kind `C`
# ----------------------------------------------------------------------------------------------------
def _check(cfg, need) -> None:
    m, p = cfg.model, cfg.parallel
    c = m.coffee
    need(c.d_state >= 1, f"model.coffee.d_state must be >= 1, got {c.d_state}")
    need(c.expand >= 1, f"model.coffee.expand must be >= 1, got {c.expand}")
    need(c.proj or c.expand == 1,
         f"model.coffee.proj=false (the bare layer: channels = model.d_model) needs model.coffee.expand=1, got {c.expand}")
    need(c.lam_param in ("bounded", "free"), f"model.coffee.lam_param must be bounded or free, got '{c.lam_param}'")
    need(len(c.lam_init) == 2 and c.lam_init[0] <= c.lam_init[1],
         f"model.coffee.lam_init must be [lo, hi] with lo <= hi, got {c.lam_init}")
    need(c.lam_param == "free" or (-2.0 < c.lam_init[0] and c.lam_init[1] < 0.0),
         f"model.coffee.lam_init={c.lam_init}: with lam_param=bounded (lam = -2 sigmoid(raw)) it must lie inside "
         "(-2, 0); use lam_param=free for the paper's lam = 0 init")
    need(c.c_init_std >= 0 and c.w_init_std >= 0,
         f"model.coffee.c_init_std and model.coffee.w_init_std must be >= 0, got {c.c_init_std} and {c.w_init_std}")
    need(c.solver in ("auto", "deer", "sequential"),
         f"model.coffee.solver must be auto, deer or sequential, got '{c.solver}'")
    need(c.deer_tol > 0, f"model.coffee.deer_tol must be positive, got {c.deer_tol}")
    need(c.deer_max_iters >= 1, f"model.coffee.deer_max_iters must be >= 1, got {c.deer_max_iters}")
    need(c.deer_jac_clip >= 0, f"model.coffee.deer_jac_clip must be >= 0 (0 = no clipping), got {c.deer_jac_clip}")
    d_coffee = c.expand * m.d_model
    need(p.tp == 1 or (c.proj and d_coffee % p.tp == 0),
         f"parallel.tp={p.tp}: COFFEE shards its channels, so it needs model.coffee.proj=true and tp dividing "
         f"model.coffee.expand x model.d_model = {d_coffee}")


def coffee_flops(m: ModelConfig, L: int) -> dict:
    """In/out projections d <-> D; per state element and token the recurrence x + sigmoid(w x) (lam x + u)
    is 3 multiply-adds and the readout C.x one (two with the +OF gate). The extra DEER Newton iterations are
    solver work, not model FLOPs (like recomputation)."""
    c = m.coffee
    D = c.expand * m.d_model if c.proj else m.d_model
    n = c.d_state
    proj = 2 * L * m.d_model * D * 2 if c.proj else 0
    return {"coffee_proj": proj, "coffee_scan": 2 * L * D * n * (3 + 1 + (1 if c.output_filter else 0))}


def coffee_activation_bytes(m, a: int, ctx) -> tuple[int, int]:
    """Rough: the projections' tensors, then what the solver keeps."""
    ch = getattr(m, "channels", ctx.cfg.d_model)
    n = ctx.cfg.coffee.d_state
    local = a * 3 * ch
    if ctx.cfg.coffee.solver == "deer":  # every fp32 state [B, L, D, n] (auto is the token loop on a GPU)
        local += 4 * ch * n
    else:  # the fused token loop (kernels.coffee_scan): y in fp32 and a state checkpoint every 64 tokens
        local += 4 * ch + 4 * ch * n // 64
    return local, 0


def coffee_tp_layout(mixer, ranks: int, sp: bool) -> TPLayout:
    """Channels are independent: in_proj column-parallel, lam / w / C / w_out cut by channel, out_proj
    row-parallel (the layer's one all-reduce); each rank runs the recurrence / solver on its own channels."""
    D = mixer.lam.shape[0]
    if mixer.in_proj is None:
        raise ValueError("tensor parallelism: COFFEE with model.coffee.proj=false has its channels on the residual "
                         "stream and cannot be split; set model.coffee.proj=true")
    if D % ranks:
        raise ValueError(f"tensor parallelism: tp={ranks} must divide the COFFEE channels ({D})")
    ch = Split(D)
    lay = TPLayout()
    lay.params = {n: Cut(0, (ch,)) for n in ("in_proj.weight", "lam", "w", "C", "w_out")}
    lay.params["out_proj.weight"] = Cut(1, (ch,))
    lay.sizes = {"channels": D // ranks}
    lay.row_parallel = {"out_proj": sp}
    return lay


BLOCK_KIND = register(BlockKind(
    letter="C", name="COFFEE", mixer=CoffeeMixer, sections=("coffee",), state=CoffeeState, check=_check,
    flop_keys=("coffee_proj", "coffee_scan"), flops=coffee_flops, activation_bytes=coffee_activation_bytes,
    tp_layout=coffee_tp_layout, cp=None, bptt=None, cuda_graph="no",
))
