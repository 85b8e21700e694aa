"""Loading a sharded checkpoint (sharded.py's layout) into a live model and optimizer, whatever the layout it was
saved in: the same chunk lists as the save (sharded_chunks.py) built for this rank's pieces as targets, views of
the live parameters and optimizer states, and DCP reads, per target, only the saved chunks that overlap it
(sharded_read.py). DeepSpeed has no chunk view: its ranks read the full canonical states (logged as a fallback)."""
from __future__ import annotations

import logging

import torch

from megassm.training.checkpoint.errors import CheckpointError
from megassm.training.checkpoint.sharded_chunks import (canonical_groups, canonical_shape, is_distopt, model_context,
                                                        optimizer_params, piece_boxes, tensor_boxes)
from megassm.training.checkpoint.sharded_read import dcp_load, dcp_metadata, read_canonical, read_layout

log = logging.getLogger("megassm.checkpoint")

__all__ = ["load_sharded"]


@torch.no_grad()
def load_sharded(path: str, model, optimizer, groups=None, engine=None) -> None:
    """Load a sharded checkpoint into this rank's model (in place) and optimizer, whatever the layout it was
    saved in: each rank reads the saved chunks that overlap its own pieces (not collective)."""
    from torch.distributed.tensor import DTensor

    if engine is not None and getattr(engine, "name", None) == "deepspeed":
        log.warning("sharded checkpoint %s -> deepspeed engine: fallback: every rank reads the full canonical "
                    "states (read_canonical) and loads them through DeepSpeed's fp32-fragment API", path)
        engine.load_states(*read_canonical(path, optim=optimizer is not None))
        return
    layout = read_layout(path)
    md = dcp_metadata(path)
    inner, tplan, pplan = model_context(model)
    tp_rank = tplan.rank if tplan is not None else 0
    targets, shapes = {}, {}
    for name, t in inner.state_dict().items():
        spec = tplan.specs.get(name) if tplan is not None else None
        shape, boxes = tensor_boxes(t, spec, tp_rank, None)
        key = "model." + name
        targets.setdefault(key, []).extend(boxes)
        shapes[key] = shape
    optim_fill = None
    if optimizer is not None:
        optim_fill = _optimizer_targets(optimizer, inner, tplan, layout, md, targets, shapes, DTensor)
    _check_shapes(md, targets, shapes, path)
    dcp_load(targets, path)
    if optim_fill is not None:
        optim_fill()


def _optimizer_targets(optimizer, inner, tplan, layout, md, targets, shapes, DTensor):
    """Register target chunks for this rank's optimizer states; returns the function that loads them into the
    optimizer once read."""
    tp_rank = tplan.rank if tplan is not None else 0
    index = {n: i for i, n in enumerate(layout["param_names"])}
    saved_groups = layout["param_groups"]
    group_of = {i: g for g in saved_groups for i in g["params"]}
    local_name = {id(p): n for n, p in inner.named_parameters()}
    keys = layout["state_keys"]

    def hyper_for(local_group) -> dict:
        if not local_group["params"]:
            return {}
        g = local_name[id(local_group["params"][0])]
        if g not in index:
            raise CheckpointError(f"the checkpoint's optimizer has no parameter '{g}'")
        return {k: v for k, v in group_of[index[g]].items() if k != "params"}

    def scalar(key):
        t = torch.zeros((), dtype=md.state_dict_metadata[key].properties.dtype)
        targets.setdefault(key, []).append(((), t))
        shapes[key] = ()
        return t

    if is_distopt(optimizer):
        full: dict = {}  # param -> {state key: full local-shaped tensor, only the owned pieces filled}
        for p, a, b, v in optimizer._views:
            g = name = local_name[id(p)]
            spec = tplan.specs.get(name) if tplan is not None else None
            st = full.setdefault(p, {})
            for k in keys:
                key = f"optim.{g}.{k}"
                if key not in md.state_dict_metadata:
                    continue
                if not md.state_dict_metadata[key].size:
                    if k not in st:
                        st[k] = scalar(key)
                    continue
                if k not in st:
                    st[k] = torch.zeros(p.shape, dtype=p.dtype)
                flat = st[k].view(-1)[a:b]
                targets.setdefault(key, []).extend(piece_boxes(p, a, b, flat, spec, tp_rank))
                shapes[key] = canonical_shape(p.shape, spec)

        def fill_distopt():
            ordered = [p for g in optimizer.param_groups for p in g["params"]]
            state = {i: full[p] for i, p in enumerate(ordered) if full.get(p)}
            optimizer.load_state_dict({"state": state, "param_groups": [
                {**hyper_for(g), "params": ids} for g, ids in zip(optimizer.param_groups, _canonical_groups_ids(optimizer))]})

        return fill_distopt

    state = {}
    for i, (g, p) in enumerate(optimizer_params(optimizer, inner)):
        name = local_name[id(p)]
        spec = tplan.specs.get(name) if tplan is not None else None
        st = {}
        for k in keys:
            key = f"optim.{g}.{k}"
            if key not in md.state_dict_metadata:
                continue
            if not md.state_dict_metadata[key].size:
                st[k] = scalar(key)
                continue
            if isinstance(p, DTensor):
                local = torch.empty_like(p.to_local())
                val = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                         run_check=False)
            else:
                local = val = torch.empty_like(p, memory_format=torch.contiguous_format).detach()
            shape, boxes = tensor_boxes(val.detach() if not isinstance(val, DTensor) else val, spec, tp_rank, None)
            targets.setdefault(key, []).extend(boxes)
            shapes[key] = shape
            st[k] = val
        if st:
            state[i] = st

    def fill():
        optimizer.load_state_dict({"state": state, "param_groups": [
            {**hyper_for(g), "params": ids} for g, ids in zip(optimizer.param_groups, _canonical_groups_ids(optimizer))]})

    return fill


def _canonical_groups_ids(optimizer) -> list:
    return [g["params"] for g in canonical_groups(optimizer)]


def _check_shapes(md, targets: dict, shapes: dict, path: str) -> None:
    missing = sorted(k for k in targets if k not in md.state_dict_metadata)
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing[:5]} ({len(missing)} tensors): saved from "
                              "another model?")
    for k, shape in shapes.items():
        saved = tuple(md.state_dict_metadata[k].size)
        if saved != tuple(shape):
            raise CheckpointError(f"checkpoint {path}: '{k}' has shape {saved}, this model {tuple(shape)}")
