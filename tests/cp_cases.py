"""The context-parallel equivalence check (test_parallel_cp*.py): CP (optionally x TP) against the
single-device model on the same canonical weights. Run through multiproc.spawn.

The batch has documents crossing rank boundaries, resets exactly at rank boundaries, a one-token document
and a row that is one document; carried initial states are given (leaves, so their gradients are checked
too). Two windows run back to back, the second starting from the first's final states with their graph
(BPTT with K=2), and one backward runs through both: outputs (logits gathered over the CP group), the
final states of both windows, every parameter gradient and the initial states' gradients must match."""
from __future__ import annotations

import json
from dataclasses import replace

import torch

from megassm.models.state import KVCache, MambaState
from megassm.parallel.tp import state_shard_specs

from compare import rel, worst
from parallel_cases import exact_device, tiny_model_config, twin_models

__all__ = ["cp_batch", "cp_equivalence_worker", "shard_states"]


def cp_batch(vocab: int, seqlen: int = 28, seed: int = 0, device="cpu") -> dict:
    """3 rows of `seqlen` = 28u tokens (rank boundaries at 14u for cp=2, at 7u/14u/21u for cp=4) with global
    document ids: row 0 has documents [0, 10u) (crosses 7u), [10u, 14u), a one-token document at 14u (a
    reset exactly at a rank boundary), [14u+1, 21u), [21u, end) (starts at a cp=4 boundary); row 1 is one
    document; row 2 has [0, 7u) (ends at a boundary), a one-token document at 7u, then [7u+1, end)."""
    if seqlen % 28:
        raise ValueError(f"cp_batch: seqlen must be a multiple of 28, got {seqlen}")
    u = seqlen // 28
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (3, seqlen), generator=g)
    labels = torch.randint(0, vocab, (3, seqlen), generator=g)
    labels[0, :3] = -100
    labels[2, 10 * u:10 * u + 2] = -100
    s = torch.zeros(3, seqlen, dtype=torch.int32)
    for start, doc in ((10 * u, 1), (14 * u, 2), (14 * u + 1, 3), (21 * u, 4)):
        s[0, start:] = doc
    s[1] = 5
    for start, doc in ((0, 6), (7 * u, 7), (7 * u + 1, 8)):
        s[2, start:] = doc
    return {k: v.to(device) for k, v in dict(tokens=tokens, labels=labels, seq_idx=s).items()}


def shard_states(states: list, model) -> list:
    """Canonical (single-device) states -> this TP rank's layout (heads / channels of its shard)."""
    from megassm.parallel.tp import plan_of, shard_canonical

    plan = plan_of(model)
    specs = state_shard_specs(states, model)
    out = []
    for i, s in enumerate(states):
        if s is None:
            out.append(None)
            continue
        names = ("conv", "ssm") if isinstance(s, MambaState) else ("k", "v")
        out.append(replace(s, **{n: shard_canonical(getattr(s, n), specs[f"{i}.{n}"], plan.rank)
                                 for n in names if f"{i}.{n}" in specs}))
    return out


def _canonical_state_grad(g: torch.Tensor, spec, plan) -> torch.Tensor:
    """A TP-local state gradient -> canonical: every rank places its pieces in a zero canonical tensor and
    the TP group sums them (replicated channels, e.g. B/C when tp > ngroups, hold partial gradients)."""
    from megassm.parallel import comm

    if spec is None:
        return g
    full_size = sum(pc.size for pc in spec.pieces)
    out = g.new_zeros(*g.shape[:1], full_size, *g.shape[2:])
    off = loff = 0
    for pc in spec.pieces:
        ln = pc.size // pc.nparts
        out.narrow(1, off + pc.parts[plan.rank] * ln, ln).copy_(g.narrow(1, loff, ln))
        off += pc.size
        loff += ln
    return comm.all_reduce(out, plan.group)


def _leaves(states: list) -> list:
    """Fresh leaf copies (requires_grad on the float tensors)."""
    out = []
    for s in states:
        if isinstance(s, MambaState):
            out.append(MambaState(conv=s.conv.detach().clone().requires_grad_(),
                                  ssm=s.ssm.detach().clone().requires_grad_()))
        elif isinstance(s, KVCache):
            out.append(KVCache(k=s.k.detach().clone().requires_grad_(), v=s.v.detach().clone().requires_grad_(),
                               valid=s.valid.clone(), pos=s.pos.clone()))
        else:
            out.append(None)
    return out


def _tensors(states: list, grads: bool = False) -> dict:
    out = {}
    for i, s in enumerate(states):
        if s is None:
            continue
        names = ("conv", "ssm") if isinstance(s, MambaState) else ("k", "v", "valid", "pos")
        for n in names:
            t = getattr(s, n)
            if grads:
                if n in ("valid", "pos"):
                    continue
                t = t.grad if t.grad is not None else torch.zeros_like(t)
            out[f"{i}.{n}"] = t.detach()
    return out


def cp_equivalence_worker(rank, world, cp, tp, cases, out_path, device="cpu", tol=1e-5, seqlen=28, sp=False,
                          checkpointing=False):
    """For each case (tiny_model_config kwargs, plus `window` for the attention's sliding window): the
    checks in the module docstring. Rank 0 writes a JSON report; any mismatch raises on the rank that
    sees it."""
    from megassm.parallel import comm
    from megassm.parallel.cp import allreduce_cp_grads, apply_context_parallel, global_token_count, local_slice
    from megassm.parallel.state import build_groups
    from megassm.parallel.tp import apply_tensor_parallel, canonical_grads, sync_tp_grads

    groups = build_groups(tp=tp, cp=cp)
    assert groups.cp == cp and comm.world(groups.cp_group) == cp  # the layout itself: parallel_cases.layout_worker
    dev = exact_device(device)
    cpg = groups.cp_group
    report = []
    for case in cases:
        case = dict(case)
        window = case.pop("window", 0)
        big = case.pop("big", False)
        mcfg = tiny_model_config(**case, big=big)
        mcfg.attn.sliding_window = window
        ref, par = twin_models(mcfg, dev)
        apply_tensor_parallel(par, groups.tp_group, sp=sp)
        apply_context_parallel(par, cpg)
        if checkpointing:  # the backward reads recomputed pieces (the gradient blocks are found by memory)
            from megassm.parallel.checkpointing import apply_activation_checkpointing

            apply_activation_checkpointing(par, keep=checkpointing if isinstance(checkpointing, str) else "pair")
        V = mcfg.vocab_size

        # carried states from a prefix through the reference: the initial states of window 1
        pre = cp_batch(V, seqlen, seed=3, device=dev)
        with torch.no_grad():
            st0 = ref(pre["tokens"], seq_idx=pre["seq_idx"], return_states=True).states
        init_ref, init_par = _leaves(st0), _leaves(shard_states(st0, par))
        b1, b2 = cp_batch(V, seqlen, seed=1, device=dev), cp_batch(V, seqlen, seed=2, device=dev)
        # window 2's rows hold other documents than window 1's (other boundaries at the rank cuts): with activation
        # checkpointing window 1's blocks recompute after window 2's forward, and must find their own CP context
        b2["seq_idx"] = b2["seq_idx"].flip(0).contiguous()
        loc = [{k: local_slice(v, cpg) for k, v in b.items()} for b in (b1, b2)]

        # outputs
        with torch.no_grad():
            lref = ref(b1["tokens"], seq_idx=b1["seq_idx"], states=st0).logits
            lpar = par(loc[0]["tokens"], seq_idx=loc[0]["seq_idx"], states=shard_states(st0, par)).logits
            lpar = comm.all_gather_dim(comm.all_gather_dim(lpar, 1, cpg), 2, groups.tp_group)
        logits_rel = rel(lpar, lref)

        # two windows with the states handed over with their graph, one backward
        def run(model, batches, init):
            comm.reset_counts()
            o1 = model(batches[0]["tokens"], seq_idx=batches[0]["seq_idx"], labels=batches[0]["labels"],
                       states=init, return_states=True)
            counts = dict(comm.COUNTS)
            o2 = model(batches[1]["tokens"], seq_idx=batches[1]["seq_idx"], labels=batches[1]["labels"],
                       states=o1.states, return_states=True)
            n = torch.stack([global_token_count(model, b["labels"]) for b in batches]).float()
            loss = (torch.stack([o1.loss, o2.loss]) * n).sum() / n.sum()
            comm.reset_counts()
            loss.backward()
            return loss.detach(), o1.states, o2.states, counts, dict(comm.COUNTS)

        loss_r, f1_r, f2_r, _, _ = run(ref, [b1, b2], init_ref)
        loss_p, f1_p, f2_p, fwd_counts, bwd_counts = run(par, loc, init_par)
        loss_rel = abs(loss_p.item() - loss_r.item()) / abs(loss_r.item())

        # final states: this rank's layout of the reference's, on every CP rank
        state_rel = {}
        for tag, fp, fr in (("w1", f1_p, f1_r), ("w2", f2_p, f2_r)):
            tp_, tr_ = _tensors(fp), _tensors(shard_states(fr, par))
            for k in tr_:
                if tr_[k].dtype in (torch.bool, torch.int64):
                    state_rel[f"{tag}.{k}"] = 0.0 if torch.equal(tp_[k], tr_[k]) else 1.0
                else:
                    state_rel[f"{tag}.{k}"] = rel(tp_[k], tr_[k]) if tr_[k].norm() > 0 else float(tp_[k].norm())

        # gradients: parameters (summed over CP, TP replicas synced, gathered canonical) and initial states
        allreduce_cp_grads(list(par.parameters()), cpg)
        sync_tp_grads(par)
        gp = canonical_grads(par)
        grad_rel = {n: rel(gp[n], p.grad.detach().cpu()) for n, p in ref.named_parameters()}
        worst_grad = max(grad_rel, key=grad_rel.get)
        from megassm.parallel.tp import plan_of

        ig_p, ig_r = _tensors(init_par, grads=True), _tensors([_grad_state(s) for s in init_ref])
        specs = state_shard_specs(init_par, par)
        init_rel = {}
        for k in ig_p:
            g = comm.all_reduce(ig_p[k].clone(), cpg)  # rank 0 holds the SSM/conv ones, every rank KV parts
            init_rel[k] = rel(_canonical_state_grad(g, specs.get(k), plan_of(par)), ig_r[k])
        rec = dict(case=case, window=window, cp=cp, tp=tp, sp=sp, logits_rel=logits_rel, loss_rel=loss_rel,
                   worst_grad=worst_grad, worst_grad_rel=grad_rel[worst_grad], state_rel=state_rel,
                   max_state_rel=worst(state_rel.values()), init_grad_rel=init_rel,
                   max_init_grad_rel=worst(init_rel.values()),
                   kinds=list(par.block_kinds), fwd_counts=fwd_counts, bwd_counts=bwd_counts)
        report.append(rec)
        bad = [k for k in ("logits_rel", "loss_rel", "worst_grad_rel", "max_state_rel", "max_init_grad_rel")
               if not rec[k] <= tol]
        if bad:
            raise AssertionError(f"rank {rank}: CP={cp} TP={tp} case {case} window {window}: {bad}: "
                                 f"{json.dumps(rec, default=str)}")
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1, default=str)


def _grad_state(s):
    """The gradients of a leaf state as a state object (zeros where none)."""
    if s is None:
        return None

    def g(t):
        return t.grad.detach() if t.grad is not None else torch.zeros_like(t)

    if isinstance(s, MambaState):
        return MambaState(conv=g(s.conv), ssm=g(s.ssm))
    return KVCache(k=g(s.k), v=g(s.v), valid=s.valid, pos=s.pos)

