"""Tiny model configs and batches of the parallel tests, the comparison helpers of every equivalence check,
and the TP-vs-single-device equivalence worker (run through multiproc.spawn)."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megassm.config import ModelConfig, MambaConfig, AttentionConfig, MLPConfig

from compare import close, randomize_, rel, worst


def exact_device(device: str) -> torch.device:
    """The worker's device; on CUDA this rank's GPU with TF32 off in cuBLAS / cuDNN (fp32 comparisons)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return dev


def twin_models(mcfg, dev: torch.device):
    """(reference, to-be-parallelized) models with the same weights: seeded init, then every parameter moved off
    it (biases and norm weights too) so a plan that drops or misplaces one shows."""
    from megassm.models import build_model

    out = []
    for _ in range(2):
        m = build_model(mcfg, device="cpu")
        m.init_weights(7)
        randomize_(m.named_parameters(), 7)
        out.append(m.to(dev))
    return tuple(out)


def tiny_model_config(pattern: str, ngroups: int = 1, n_kv_heads: int = 2, tie: bool = True,
                      norm_before_gate: bool = False, proj_bias: bool = False, attn_bias: bool = False,
                      big: bool = False) -> ModelConfig:
    """proj_bias: biases on the Mamba projections and the MLP; attn_bias: on the attention projections."""
    if big:  # GPU checks: real-ish shapes
        return ModelConfig(pattern=pattern, d_model=1024, vocab_size=32000, tie_embeddings=tie,
                           mamba=MambaConfig(d_state=128, headdim=64, ngroups=ngroups, chunk_size=128,
                                             norm_before_gate=norm_before_gate, proj_bias=proj_bias),
                           attn=AttentionConfig(n_heads=16, n_kv_heads=n_kv_heads, bias=attn_bias),
                           mlp=MLPConfig(ffn_hidden=2048, bias=proj_bias))
    return ModelConfig(
        pattern=pattern, d_model=32, vocab_size=100, pad_vocab_multiple=16, tie_embeddings=tie,
        mamba=MambaConfig(d_state=8, headdim=8, expand=2, ngroups=ngroups, chunk_size=8,
                          norm_before_gate=norm_before_gate, proj_bias=proj_bias),
        attn=AttentionConfig(n_heads=4, n_kv_heads=n_kv_heads, bias=attn_bias),
        mlp=MLPConfig(ffn_hidden=64, bias=proj_bias),
    )


def make_batch(vocab: int, bsz: int, seqlen: int, seed: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (bsz, seqlen), generator=g)
    labels = torch.randint(0, vocab, (bsz, seqlen), generator=g)
    labels[0, :3] = -100
    seq_idx = torch.zeros(bsz, seqlen, dtype=torch.int32)
    seq_idx[0, seqlen // 3:] = 1  # a document boundary inside row 0
    seq_idx[0, 2 * seqlen // 3 + 1:] = 2
    return {k: v.to(device) for k, v in dict(tokens=tokens, labels=labels, seq_idx=seq_idx).items()}


def layer_collectives(case: dict, kinds, tp: int, sp: bool) -> list[dict]:
    """The collectives each layer's forward issues under TP (equivalence_worker's per_layer_fwd): the
    row-parallel all-reduce (SP: its reduce-scatter, plus the all-gather in front of the layer), and for a
    Mamba-2 layer whose norm groups span ranks (tp > ngroups) the all-reduce of its norm statistics."""
    base = {"all_gather": 1, "reduce_scatter": 1} if sp else {"all_reduce": 1}
    spans = case.get("ngroups", 1) % tp != 0
    return [dict(base, all_reduce=base.get("all_reduce", 0) + 1) if k == "M" and spans else base for k in kinds]


def equivalence_worker(rank, world, tp, sp, cases, out_path, steps=3, device="cpu", tol=1e-5, seqlen=24, bsz=2):
    """For each case (dict of tiny_model_config kwargs): single-device reference vs TP (this group) on the
    same batch: loss, logits (gathered), every canonical gradient, `steps` AdamW steps with clipping, and the
    collectives of one layer forward/backward. Every parameter (biases and norm weights too) is moved off its
    init first. Raises on any mismatch or non-finite value; rank 0 writes a JSON report to out_path."""
    from megassm.training.optim import clip_grad_norm

    from megassm.parallel import comm
    from megassm.parallel.state import build_groups
    from megassm.parallel.tp import (apply_tensor_parallel, canonical_grads, canonical_state_dict, clip_grad_norm_tp,
                                     sync_tp_grads)

    groups = build_groups(tp=tp)
    dev = exact_device(device)
    report = []
    for case in cases:
        big = case.pop("big", False)
        sections = case.pop("sections", {})  # {"coffee": {...}, "bmojo": {...}}: overrides of model sub-configs
        mcfg = tiny_model_config(**case, big=big)
        for sec, vals in sections.items():
            for key, val in vals.items():
                setattr(getattr(mcfg, sec), key, val)
        if sections:
            case["sections"] = sections
        ref, par = twin_models(mcfg, dev)
        apply_tensor_parallel(par, groups.tp_group, sp=sp)
        batch = make_batch(mcfg.vocab_size, bsz, seqlen, seed=1, device=dev)

        # outputs
        with torch.no_grad():
            lref = ref(batch["tokens"], seq_idx=batch["seq_idx"]).logits
            lpar = par(batch["tokens"], seq_idx=batch["seq_idx"]).logits
            lpar = comm.all_gather_dim(lpar, 2, groups.tp_group)
        logits_rel = rel(lpar, lref)
        # one-token decoding (states hold this rank's heads / channels)
        with torch.no_grad():
            st_r, st_p = ref.allocate_states(bsz), par.allocate_states(bsz)
            dec = []
            for t in range(4):
                lr_, st_r = ref.step(batch["tokens"][:, t], st_r)
                lp_, st_p = par.step(batch["tokens"][:, t], st_p)
                dec.append(rel(comm.all_gather_dim(lp_, 1, groups.tp_group), lr_))
        decode_rel = worst(dec)

        # per-layer collectives of one forward and backward
        counts = []

        def pre(m, a):
            m._c0 = dict(comm.COUNTS)

        def post(m, a, o):
            counts.append({k: comm.COUNTS[k] - m._c0.get(k, 0) for k in comm.COUNTS if comm.COUNTS[k] - m._c0.get(k, 0)})

        hs = [l.mixer.register_forward_pre_hook(pre, prepend=True) for l in par.layers]
        hs += [l.mixer.register_forward_hook(post) for l in par.layers]
        comm.reset_counts()
        out = par(batch["tokens"], seq_idx=batch["seq_idx"], labels=batch["labels"])
        fwd_total = dict(comm.COUNTS)
        for h in hs:
            h.remove()
        comm.reset_counts()
        out.loss.backward()
        bwd_total = dict(comm.COUNTS)
        ref_out = ref(batch["tokens"], seq_idx=batch["seq_idx"], labels=batch["labels"])
        ref_out.loss.backward()
        sync_tp_grads(par)
        gp, gr = canonical_grads(par), {n: p.grad.detach().cpu() for n, p in ref.named_parameters()}
        grad_rel = {n: rel(gp[n], gr[n]) for n in gr}
        worst_grad = max(grad_rel, key=grad_rel.get)
        loss_rel = abs(out.loss.item() - ref_out.loss.item()) / abs(ref_out.loss.item())
        norm_p = clip_grad_norm_tp(par, 0.0)
        norm_r = clip_grad_norm(ref.parameters(), 0.0)

        # optimizer steps (clip at a small norm so that clipping is active)
        losses_p, losses_r = [], []
        opt_p = torch.optim.AdamW(par.param_groups(0.1), lr=1e-3)
        opt_r = torch.optim.AdamW(ref.param_groups(0.1), lr=1e-3)
        for s in range(steps):
            for m, o, lst in ((par, opt_p, losses_p), (ref, opt_r, losses_r)):
                o.zero_grad(set_to_none=True)
                b = make_batch(mcfg.vocab_size, bsz, seqlen, seed=10 + s, device=dev)
                loss = m(b["tokens"], seq_idx=b["seq_idx"], labels=b["labels"]).loss
                loss.backward()
                if m is par:
                    sync_tp_grads(par)
                    clip_grad_norm_tp(par, 0.5)
                else:
                    clip_grad_norm(ref.parameters(), 0.5)
                o.step()
                lst.append(loss.item())
        final = canonical_state_dict(par)
        prel = {n: rel(final[n], p.detach().cpu()) for n, p in ref.named_parameters()}
        worst_param = max(prel, key=prel.get)
        param_rel = prel[worst_param]
        step_rel = worst(abs(a - b) / abs(b) for a, b in zip(losses_p, losses_r))
        rec = dict(case=case, tp=tp, sp=sp, logits_rel=logits_rel, decode_rel=decode_rel, loss_rel=loss_rel,
                   worst_grad=worst_grad, worst_grad_rel=grad_rel[worst_grad], grad_norm=(norm_p, norm_r), step_losses=losses_p,
                   step_loss_rel=step_rel, param_rel_after_steps=param_rel, worst_param=worst_param, per_layer_fwd=counts,
                   kinds=list(par.block_kinds), fwd_total=fwd_total, bwd_total=bwd_total)
        report.append(rec)
        bad = [k for k in ("logits_rel", "decode_rel", "loss_rel", "worst_grad_rel", "step_loss_rel") if not rec[k] <= tol]
        if not close(norm_p, norm_r, tol):
            bad.append("grad_norm")
        if not param_rel <= 10 * tol:
            bad.append("param_rel_after_steps")
        if bad:
            raise AssertionError(f"rank {rank}: TP={tp} sp={sp} case {case}: {bad}: {json.dumps(rec, default=str)}")
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1, default=str)


def layout_worker(rank, world, layouts, out_path):
    """For each (tp, cp, pp) in `layouts`: megatron-core's groups (MEGASSM_PROCESS_GROUPS=megatron) and the
    plain builder's are the same groups (tp, dp, cp, pp, embedding: ranks and this rank's indices) and follow
    state.rank_layout / cp_layout / pp_layout. What lets the CPU suite build its groups with the plain builder.
    Rank 0 writes the megatron-core groups it saw, per layout, to out_path."""
    from megassm.parallel.state import (_build_groups_torch, build_groups, cp_layout, dp_cp_layout, pp_layout,
                                        rank_layout)

    def ranks(g):
        return dist.get_process_group_ranks(g) if g is not None else None

    def described(g):
        return dict(tp=ranks(g.tp_group), dp=ranks(g.dp_group), cp=ranks(g.cp_group), pp=ranks(g.pp_group),
                    emb=ranks(g.emb_group), dp_cp=ranks(g.dp_cp_group),
                    idx=[g.tp_rank, g.dp_rank, g.cp_rank, g.pp_rank, g.dp])

    os.environ["MEGASSM_PROCESS_GROUPS"] = "megatron"
    seen = []
    for tp, cp, pp in layouts:
        gm = build_groups(tp=tp, cp=cp, pp=pp)
        assert gm.megatron
        m, t = described(gm), described(_build_groups_torch(tp, cp, pp))
        assert m == t, (tp, cp, pp, m, t)
        tp_groups, dp_groups = rank_layout(world, tp, cp, pp)
        assert m["tp"] in tp_groups and m["dp"] in dp_groups, m
        assert m["cp"] in cp_layout(world, tp, cp, pp) and m["pp"] in pp_layout(world, tp, cp, pp), m
        assert m["dp_cp"] in dp_cp_layout(world, tp, cp, pp) and (cp > 1 or m["dp_cp"] == m["dp"]), m
        seen.append(dict(layout=[tp, cp, pp], **m))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(layouts=seen, backend=dist.get_backend(gm.tp_group)), f)
