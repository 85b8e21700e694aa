"""The pipeline-parallel equivalence check (test_parallel_pp*.py): PP (optionally x TP, x DP) against
the single-device model on the same canonical weights and the same micro-batches. Run through
multiproc.spawn.

Per case, every rank runs the single-device reference on all micro-batches of the global batch (tiny
models) and its pipelined stage(s) on its data-parallel share, through the same calls the trainer makes:
train_step -> sync_tp_grads / sync_embedding_grads / DP average -> clip_grad_norm_pp -> AdamW. Checked:
the step losses, every gradient of every stage (single-device names; a tied embedding's last-stage copy must hold
the full gradient too), the global grad norm, the parameters after a few clipped AdamW steps, eval losses,
the canonical checkpoint gathered on rank 0 (model and optimizer state, single-device order), and a
canonical load into a fresh pipeline that then takes the same next step."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from compare import close, randomize_, rel, worst
from parallel_cases import exact_device, make_batch, tiny_model_config

__all__ = ["build_pipeline", "pp_equivalence_worker"]


def build_pipeline(mcfg, groups, virtual: int = 1, schedule: str = "1f1b", sp: bool = False, seed: int = 7,
                   device="cpu", ac: bool = False):
    """The trainer's construction: meta model -> this rank's stages -> canonical init -> TP -> PP (->
    activation checkpointing)."""
    from megassm.models import build_model

    from megassm.parallel.pp import apply_pipeline_parallel, init_stage_weights, split_model
    from megassm.parallel.tp import apply_tensor_parallel

    model = build_model(mcfg, device="meta")
    split_model(model, groups.pp, groups.pp_rank, virtual=virtual, group=groups.pp_group, emb_group=groups.emb_group)
    model.to_empty(device="cpu")
    init_stage_weights(model, seed)
    # every parameter off its init, by its (single-device) name: as randomize_ does on the reference
    randomize_(model.named_parameters(), seed)
    model.to(device)
    if groups.tp > 1:
        apply_tensor_parallel(model, groups.tp_group, sp=sp)
    apply_pipeline_parallel(model, schedule=schedule)
    if ac:
        from megassm.parallel.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    return model


def _finish(model, groups):
    from megassm.parallel.dp import allreduce_grads
    from megassm.parallel.pp import sync_embedding_grads
    from megassm.parallel.tp import sync_tp_grads

    sync_tp_grads(model)
    sync_embedding_grads(model)
    allreduce_grads(list(model.parameters()), groups.dp_group)


def _stage_grads(model) -> dict:
    """{name: canonical (TP-gathered) gradient} of this rank's stages."""
    from megassm.parallel.tp import canonical_grads

    return canonical_grads(model)


def _stage_params(model) -> dict:
    from megassm.parallel.tp import canonical_state_dict

    return canonical_state_dict(model)


def _param_rels(model, ref) -> dict:
    """{name: relative difference} of this rank's (canonical) parameters against the reference's."""
    rparams = {name: p.detach().cpu() for name, p in ref.named_parameters()}
    return {name: rel(v, rparams[name]) for name, v in _stage_params(model).items()}


def pp_equivalence_worker(rank, world, tp, pp, cases, out_path, device="cpu", tol=1e-5, steps=2):
    """cases: dicts with `model` (tiny_model_config kwargs) and optional virtual, schedule, sp, ac
    (activation checkpointing), n_micro, micro_batch, seqlen. Raises on any mismatch; rank 0 writes a JSON
    report to out_path."""
    from megassm.models import build_model
    from megassm.training.optim import clip_grad_norm

    from megassm.parallel.pp import clip_grad_norm_pp, eval_losses, gather_canonical_states, load_canonical_states, train_step
    from megassm.parallel.state import build_groups

    groups = build_groups(tp=tp, pp=pp)
    dev = exact_device(device)
    dp = groups.dp
    report = []
    for case in cases:
        mcfg = tiny_model_config(**case["model"])
        virtual, schedule, sp = case.get("virtual", 1), case.get("schedule", "1f1b"), case.get("sp", False)
        ac = case.get("ac", False)
        n, mb, seqlen = case.get("n_micro", 4), case.get("micro_batch", 2), case.get("seqlen", 24)

        ref = build_model(mcfg, device="cpu")
        ref.init_weights(7)
        randomize_(ref.named_parameters(), 7)
        ref.to(dev)
        par = build_pipeline(mcfg, groups, virtual, schedule, sp, device=dev, ac=ac)

        def micro(step):  # every micro-batch of the global batch; this DP rank's share
            allb = [make_batch(mcfg.vocab_size, mb, seqlen, seed=100 * step + i, device=dev) for i in range(n * dp)]
            return allb, allb[groups.dp_rank * n:(groups.dp_rank + 1) * n]

        def ref_step(allb):
            total = 0.0
            for b in allb:
                loss = ref(b["tokens"], seq_idx=b["seq_idx"], labels=b["labels"]).loss
                (loss / len(allb)).backward()
                total += loss.item()
            return total / len(allb)

        # one step: losses, every gradient, the global norm
        allb, mine = micro(0)
        loss_p = train_step(par, mine).item() / n
        loss_p = float(comm_mean(loss_p, groups, dev))
        loss_r = ref_step(allb)
        _finish(par, groups)
        gp = _stage_grads(par)
        gr = {name: p.grad.detach().cpu() for name, p in ref.named_parameters()}
        grad_rel = {name: rel(g, gr[name]) for name, g in gp.items()}
        worst_grad = max(grad_rel, key=grad_rel.get)
        norm_p = clip_grad_norm_pp(par, 0.0)
        norm_r = clip_grad_norm(ref.parameters(), 0.0)

        # clipped AdamW steps (lr high enough that a wrong gradient shows)
        opt_p = torch.optim.AdamW(par.param_groups(0.1), lr=1e-3)
        opt_r = torch.optim.AdamW(ref.param_groups(0.1), lr=1e-3)
        step_losses = []
        for s in range(steps):
            if s > 0:
                opt_p.zero_grad(set_to_none=True)
                opt_r.zero_grad(set_to_none=True)
                allb, mine = micro(s)
                lp = float(comm_mean(train_step(par, mine).item() / n, groups, dev))
                lr_ = ref_step(allb)
                _finish(par, groups)
                step_losses.append((lp, lr_))
            clip_grad_norm_pp(par, 0.5)
            clip_grad_norm(ref.parameters(), 0.5)
            opt_p.step()
            opt_r.step()
        prel = _param_rels(par, ref)
        worst_param = max(prel, key=prel.get)

        # eval (forward only), on batches of another step
        allb, mine = micro(50)
        ev_p = float(comm_mean(eval_losses(par, mine).item() / n, groups, dev))
        with torch.no_grad():
            ev_r = sum(ref(b["tokens"], seq_idx=b["seq_idx"], labels=b["labels"]).loss.item() for b in allb) / len(allb)

        # canonical checkpoint on rank 0 (model + optimizer), and a canonical load into a fresh pipeline
        ms, os_ = gather_canonical_states(par, opt_p, groups)
        ckpt_rel = None
        if rank == 0:
            ref_sd, ref_os = ref.state_dict(), opt_r.state_dict()
            assert list(ms) == list(ref_sd), (list(ms), list(ref_sd))
            ckpt_rel = worst(rel(ms[k], ref_sd[k].cpu()) for k in ref_sd)
            assert [g["params"] for g in os_["param_groups"]] == [g["params"] for g in ref_os["param_groups"]]
            assert sorted(os_["state"]) == sorted(ref_os["state"])
            for i, st in ref_os["state"].items():
                for k in ("exp_avg", "exp_avg_sq"):
                    r = rel(os_["state"][i][k], st[k].cpu())
                    assert r <= 10 * tol, (case, i, k, r)  # rel() is inf for a non-finite value
        fresh = build_pipeline(mcfg, groups, virtual, schedule, sp, seed=123, device=dev, ac=ac)
        opt_f = torch.optim.AdamW(fresh.param_groups(0.1), lr=1e-3)
        load_canonical_states(fresh, opt_f, {k: v.cpu() for k, v in ref.state_dict().items()},
                              _cpu(opt_r.state_dict()))
        allb, mine = micro(60)
        for m_, o_ in ((fresh, opt_f), (par, opt_p)):
            o_.zero_grad(set_to_none=True)
        opt_r.zero_grad(set_to_none=True)
        lf = float(comm_mean(train_step(fresh, mine).item() / n, groups, dev))
        lr2 = ref_step(allb)
        _finish(fresh, groups)
        clip_grad_norm_pp(fresh, 0.5)
        clip_grad_norm(ref.parameters(), 0.5)
        opt_f.step()
        opt_r.step()
        load_rels = _param_rels(fresh, ref)
        load_worst = max(load_rels, key=load_rels.get)
        load_rel = load_rels[load_worst]

        rec = dict(case=case, tp=tp, pp=pp, dp=dp, loss=(loss_p, loss_r), worst_grad=worst_grad,
                   worst_grad_rel=grad_rel[worst_grad], grad_norm=(norm_p, norm_r), step_losses=step_losses,
                   worst_param=worst_param, param_rel=prel[worst_param], eval=(ev_p, ev_r), ckpt_rel=ckpt_rel,
                   load_step_loss=(lf, lr2), load_param_rel=load_rel, load_worst=load_worst, grads_checked=sorted(gp))
        report.append(rec)
        bad = []
        if not close(loss_p, loss_r, tol):
            bad.append("loss")
        if not grad_rel[worst_grad] <= tol:
            bad.append("grads")
        if not close(norm_p, norm_r, tol):
            bad.append("grad_norm")
        if not all(close(a, b, tol) for a, b in step_losses):
            bad.append("step_losses")
        if not prel[worst_param] <= 10 * tol:
            bad.append("params_after_steps")
        if not close(ev_p, ev_r, tol):
            bad.append("eval")
        if ckpt_rel is not None and not ckpt_rel <= 10 * tol:
            bad.append("checkpoint")
        if not close(lf, lr2, tol) or not load_rel <= 10 * tol:
            bad.append("canonical_load")
        if bad:
            raise AssertionError(f"rank {rank}: PP={pp} TP={tp} DP={dp} case {case}: {bad}: "
                                 f"{json.dumps(rec, default=str)}")
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1, default=str)


def comm_mean(x: float, groups, dev) -> torch.Tensor:
    """A float averaged over the data-parallel group."""
    t = torch.tensor(float(x), device=dev, dtype=torch.float64 if dev.type == "cpu" else torch.float32)
    if groups.dp > 1:
        dist.all_reduce(t, group=groups.dp_group)
        t /= groups.dp
    return t


def _cpu(sd: dict) -> dict:
    """A CPU copy of an optimizer state dict (as read from a checkpoint: no tensor shared with the live one)."""
    return {"state": {k: {n: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for n, v in st.items()}
                      for k, st in sd["state"].items()},
            "param_groups": sd["param_groups"]}
