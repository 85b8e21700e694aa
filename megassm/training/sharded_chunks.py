"""What a rank holds of the canonical state, as chunks (the geometry of sharded checkpoints, sharded.py):
{dcp key: (canonical shape, [(offsets, tensor view)])} for its model and optimizer pieces under TP, FSDP2,
ZeRO-1, PP and DP / CP replicas, and the canonical orders (layout.pt) rank 0 records beside them."""
from __future__ import annotations

import math

import torch
from megassm.training import checkpoint as ckpt

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


def flat_boxes(shape, a: int, b: int) -> list:
    """The flat element range [a, b) of a row-major tensor of `shape` as boxes (offsets, sizes), in order; each
    box is contiguous in the flat order, so the range's flat values viewed per box tile it."""
    shape = tuple(shape)
    if a >= b:
        return []
    if len(shape) <= 1:
        return [((a,) if shape else (), (b - a,) if shape else ())]
    inner = math.prod(shape[1:])
    r0, r1 = a // inner, (b - 1) // inner
    if r0 == r1:
        return [((r0,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], a - r0 * inner, b - r0 * inner)]
    out = []
    if a % inner:
        out += [((r0,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], a - r0 * inner, inner)]
        r0 += 1
    full = b // inner
    if full > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (full - r0,) + shape[1:]))
    if b % inner:
        out += [((full,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], 0, b - full * inner)]
    return out


def _held(t: torch.Tensor) -> tuple[list, tuple, bool]:
    """(boxes, local-layout shape, replicated): the boxes (offsets, view) of `t` this rank holds, in the
    coordinates of the (TP-local) tensor whose shape is returned; replicated: a plain tensor every data-parallel
    replica holds whole."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = t.to_local()
        if local.numel() == 0:
            return [], tuple(t.shape), False
        (chunk,) = t.__create_chunk_list__()
        return [(tuple(chunk.offsets), local)], tuple(t.shape), False
    return [((0,) * t.dim(), t)], tuple(t.shape), True


# ----------------------------------------------------------------------------------------------------
# what this rank holds: {dcp key: (canonical shape, [(offsets, tensor view)])}
# ----------------------------------------------------------------------------------------------------
def model_context(model):
    from megassm.parallel import pp as ppl
    from megassm.parallel.tp import plan_of

    inner = ckpt.unwrap_model(ppl._unwrap(model))
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
    held, shape, replicated = _held(t)
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


def is_zero1(optimizer) -> bool:
    return hasattr(optimizer, "flat") and hasattr(optimizer, "_views")


def zero1_boxes(p, a: int, b: int, flat_state: torch.Tensor, spec, tp_rank: int) -> list:
    """Canonical boxes of a ZeRO-1 piece [a, b) of parameter p whose state values are `flat_state` ((b - a,))."""
    out = []
    for offs, sizes in flat_boxes(p.shape, a, b):
        start = _flat_index(p.shape, offs) - a
        view = flat_state[start:start + math.prod(sizes)].view(sizes)
        out += to_canonical(offs, view, spec, tp_rank)
    return out


def _flat_index(shape, offs) -> int:
    idx, stride = 0, 1
    for d in range(len(shape) - 1, -1, -1):
        idx += offs[d] * stride
        stride *= shape[d]
    return idx


@torch.no_grad()
def save_entries(model, optimizer, groups) -> dict:
    """This rank's pieces of the canonical model and optimizer states, replicas split (views, not copies)."""
    from megassm.parallel import pp as ppl

    inner, tplan, pplan = model_context(model)
    tp_rank = tplan.rank if tplan is not None else 0
    rep = _replicas(groups)
    skip = ppl._tied_copy(pplan) if pplan is not None else set()
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
    if is_zero1(optimizer):  # this rank's flat pieces: disjoint over DP, no replica split
        states = optimizer._piece_states()
        for (p, a, b, _), st in zip(optimizer._views, states):
            g = name = local_name[id(p)]
            spec = tplan.specs.get(name) if tplan is not None else None
            cshape = canonical_shape(p.shape, spec)
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() == 0:
                    _add(entries, f"optim.{g}.{k}", (), [((), v)])
                elif torch.is_tensor(v):
                    _add(entries, f"optim.{g}.{k}", cshape, zero1_boxes(p, a, b, v, spec, tp_rank))
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
    st = optimizer._piece_states() if is_zero1(optimizer) else list(optimizer.state.values())
    for s in st:
        if s:
            return list(s.keys())
    return ["step", "exp_avg", "exp_avg_sq"]
