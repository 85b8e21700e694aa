"""What a rank holds of the canonical state, as chunks (the geometry of sharded checkpoints, sharded.py):
{dcp key: (canonical shape, [(offsets, tensor view)])} for its model and optimizer pieces under TP, FSDP2,
the distributed optimizer, PP and DP / CP replicas, and the canonical orders (layout.pt) rank 0 records beside
them."""
from __future__ import annotations

import torch
from megassm.parallel.distopt import range_boxes
from megassm.training.checkpoint.state import unwrap_model

# ----------------------------------------------------------------------------------------------------
# chunk geometry
# ----------------------------------------------------------------------------------------------------
def canonical_shape(shape, spec) -> tuple:
    s = list(shape)
    if spec is not None:
        s[spec.dim] = sum(pc.size for pc in spec.pieces)
    return tuple(s)


def to_canonical(offsets: tuple, t: torch.Tensor, spec, tp_rank: int) -> list:
    """A box of a TP-local tensor (offsets in the local tensor, view t) as boxes of the canonical tensor: one per
    ShardSpec piece it crosses (parallel/tp.py: piece j of the local tensor along spec.dim is slice parts[rank]
    of component j)."""
    if spec is None:
        return [(tuple(offsets), t)]
    d = spec.dim
    b0, b1 = offsets[d], offsets[d] + t.shape[d]
    out, loff, coff = [], 0, 0
    for pc in spec.pieces:
        ln = pc.size // pc.nparts
        lo, hi = max(b0, loff), min(b1, loff + ln)
        if lo < hi:
            o = list(offsets)
            o[d] = coff + pc.parts[tp_rank] * ln + (lo - loff)
            out.append((tuple(o), t.narrow(d, lo - b0, hi - lo)))
        loff += ln
        coff += pc.size
    return out


def _split_rows(offsets: tuple, t: torch.Tensor, r: int, n_rep: int) -> list:
    """Replica r's share of a replicated chunk: row block r of n_rep (0-dim tensors: replica 0)."""
    if n_rep == 1:
        return [(offsets, t)]
    if t.dim() == 0:
        return [(offsets, t)] if r == 0 else []
    n = t.shape[0]
    a, b = r * n // n_rep, (r + 1) * n // n_rep
    if a == b:
        return []
    o = list(offsets)
    o[0] += a
    return [(tuple(o), t.narrow(0, a, b - a))]


def _held(t: torch.Tensor, split: bool = False) -> tuple[list, tuple, bool]:
    """(boxes, local-layout shape, replicated): the boxes (offsets, view) of `t` this rank holds, in the
    coordinates of the (TP-local) tensor whose shape is returned; replicated: a plain tensor every data-parallel
    replica holds whole. `split` (saving): a DTensor shard that several mesh ranks hold alike (HSDP's replicate
    dimension) is cut into row blocks, replica r offering block r, so the replicas share the writing."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(t, DTensor):
        local = t.to_local()
        if local.numel() == 0:
            return [], tuple(t.shape), False
        (chunk,) = t.__create_chunk_list__()
        boxes = [(tuple(chunk.offsets), local)]
        if split:
            mesh = t.device_mesh
            for d, pl in enumerate(t.placements):
                if isinstance(pl, Replicate) and mesh.size(d) > 1:
                    boxes = [b for o, v in boxes for b in _split_rows(o, v, mesh.get_local_rank(d), mesh.size(d))]
        return boxes, tuple(t.shape), False
    return [((0,) * t.dim(), t)], tuple(t.shape), True


# ----------------------------------------------------------------------------------------------------
# what this rank holds: {dcp key: (canonical shape, [(offsets, tensor view)])}
# ----------------------------------------------------------------------------------------------------
def model_context(model):
    from megassm.parallel import pp as ppl
    from megassm.parallel.tp import plan_of

    inner = unwrap_model(ppl.unwrap(model))
    tplan, pplan = plan_of(inner), ppl.pp_plan_of(inner)
    return inner, tplan, pplan


def _replicas(groups) -> tuple[int, int]:
    """(index of this rank among the ranks holding the same local states, their number): DP x CP."""
    if groups is None:
        return 0, 1
    return groups.dp_rank * groups.cp + groups.cp_rank, groups.dp * groups.cp


def _add(entries: dict, key: str, shape: tuple, boxes: list) -> None:
    ent = entries.setdefault(key, (shape, []))
    if ent[0] != shape:
        raise RuntimeError(f"sharded checkpoint: '{key}' has canonical shape {shape} and {ent[0]}")
    ent[1].extend(boxes)


def tensor_boxes(t, spec, tp_rank: int, rep: tuple | None) -> tuple[tuple, list]:
    """(canonical shape, canonical boxes) of tensor t (a parameter / state of this rank); `rep` = (r, n) splits a
    replicated tensor's chunks over its replicas (saving), None keeps them whole (loading targets)."""
    held, shape, replicated = _held(t, split=rep is not None)
    out = []
    for offs, view in held:
        for co, cv in to_canonical(offs, view, spec, tp_rank):
            out += _split_rows(co, cv, *rep) if (rep is not None and replicated) else [(co, cv)]
    return canonical_shape(shape, spec), out


def canonical_param_names(model, optimizer, engine=None) -> list[str]:
    """The canonical optimizer order (the index of a parameter in optim.pt): the single-device optimizer's
    parameter order by name."""
    inner, _, pplan = model_context(model)
    if pplan is not None:
        return list(pplan.decay_names) + list(pplan.no_decay_names)
    if engine is not None and getattr(engine, "name", None) == "deepspeed":
        return [n for names in engine._names for n in names]
    order = _engine_order(engine)
    if order is not None:  # FSDP2: its optimizer splits the canonical groups (sharded / replicated parameters)
        return [n for _, names in order for n in names]
    name_of = {id(p): n for n, p in inner.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def optimizer_params(optimizer, inner) -> list:
    """[(name, param)] in this optimizer's (local) order."""
    name_of = {id(p): n for n, p in inner.named_parameters()}
    return [(name_of[id(p)], p) for g in optimizer.param_groups for p in g["params"]]


def is_distopt(optimizer) -> bool:
    """The distributed optimizer (parallel/distopt.py): AdamW states for this rank's flat pieces only."""
    from megassm.parallel.distopt import DistributedAdamW

    return isinstance(optimizer, DistributedAdamW)


def piece_boxes(p, a: int, b: int, flat_state: torch.Tensor, spec, tp_rank: int) -> list:
    """Canonical boxes of the distributed optimizer's piece [a, b) (flat elements) of parameter p whose state
    values are `flat_state` ((b - a,))."""
    return [c for offs, view in range_boxes(p.shape, a, b, flat_state) for c in to_canonical(offs, view, spec, tp_rank)]


@torch.no_grad()
def save_entries(model, optimizer, groups) -> dict:
    """This rank's pieces of the canonical model and optimizer states, replicas split (views, not copies)."""
    from megassm.parallel import pp as ppl

    inner, tplan, pplan = model_context(model)
    tp_rank = tplan.rank if tplan is not None else 0
    rep = _replicas(groups)
    skip = ppl.tied_copy(pplan) if pplan is not None else set()
    entries: dict = {}
    for name, t in inner.state_dict().items():
        if name in skip:
            continue
        spec = tplan.specs.get(name) if tplan is not None else None
        shape, boxes = tensor_boxes(t, spec, tp_rank, rep)
        _add(entries, "model." + name, shape, boxes)
    if optimizer is None:
        return entries
    local_name = {id(p): n for n, p in inner.named_parameters()}
    if is_distopt(optimizer):  # this rank's flat pieces: disjoint over DP x CP, no replica split
        states = optimizer._piece_states()
        for (p, a, b, _), st in zip(optimizer._views, states):
            g = name = local_name[id(p)]
            if g in skip:  # the last stage's copy of a tied embedding: the first stage writes it
                continue
            spec = tplan.specs.get(name) if tplan is not None else None
            cshape = canonical_shape(p.shape, spec)
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() == 0:
                    _add(entries, f"optim.{g}.{k}", (), [((), v)])
                elif torch.is_tensor(v):
                    _add(entries, f"optim.{g}.{k}", cshape, piece_boxes(p, a, b, v, spec, tp_rank))
                else:
                    raise RuntimeError(f"sharded checkpoint: optimizer state '{k}' of '{g}' is not a tensor")
        return entries
    for g, p in optimizer_params(optimizer, inner):
        if g in skip:
            continue
        spec = tplan.specs.get(local_name[id(p)]) if tplan is not None else None
        for k, v in optimizer.state.get(p, {}).items():
            if torch.is_tensor(v) and v.dim() == 0:
                _add(entries, f"optim.{g}.{k}", (), [((), v)])  # every holder offers it: DCP writes it once
            elif torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape):
                shape, boxes = tensor_boxes(v, spec, tp_rank, rep)
                _add(entries, f"optim.{g}.{k}", shape, boxes)
            else:
                raise RuntimeError(f"sharded checkpoint: optimizer state '{k}' of '{g}' is neither a scalar nor "
                                   "shaped like its parameter (only AdamW-like optimizers are supported)")
    return entries


def entries_from_canonical(model_state: dict, optim_state: dict | None, param_names: list) -> dict:
    """Full canonical tensors as single chunks (the converter; DeepSpeed's gathered states on rank 0)."""
    entries = {}
    for k, v in model_state.items():
        entries["model." + k] = (tuple(v.shape), [((0,) * v.dim(), v)])
    if optim_state is not None:
        for i, st in optim_state["state"].items():
            name = param_names[int(i)]
            for k, v in st.items():
                if not torch.is_tensor(v):
                    raise ValueError(f"optimizer state '{k}' of '{name}' is not a tensor ({type(v).__name__})")
                entries[f"optim.{name}.{k}"] = (tuple(v.shape), [((0,) * v.dim(), v)])
    return entries


_LAYOUT_VERSION = 1


def layout_record(model_keys: list, param_names: list, param_groups: list, state_keys: list) -> dict:
    return {"version": _LAYOUT_VERSION, "model_keys": list(model_keys), "param_names": list(param_names),
            "param_groups": param_groups, "state_keys": list(state_keys)}


def _engine_order(engine):
    """The engine's canonical optimizer groups [(hyperparameters, names)] where its optimizer's groups are not
    the single-device ones (FSDP2Engine.canonical_order), else None."""
    order = getattr(engine, "canonical_order", None)
    return order() if order is not None else None


def canonical_groups(optimizer, engine=None) -> list:
    """The single-device optimizer's param_groups, parameters as indices in canonical_param_names' order."""
    order = _engine_order(engine)
    if order is None:
        order = [({k: v for k, v in g.items() if k != "params"}, g["params"]) for g in optimizer.param_groups]
    groups, off = [], 0
    for hyper, params in order:
        n = len(params)
        groups.append({**hyper, "params": list(range(off, off + n))})
        off += n
    return groups


def state_keys(optimizer) -> list:
    st = optimizer._piece_states() if is_distopt(optimizer) else list(optimizer.state.values())
    for s in st:
        if s:
            return list(s.keys())
    return ["step", "exp_avg", "exp_avg_sq"]
