"""Reading a sharded checkpoint (sharded.py's layout) through torch.distributed.checkpoint: its
layout.pt, DCP's metadata, target chunks filled by DCP (dcp_load), and the canonical states assembled in one
process (read_canonical). Below both load.py, whose loaders read either format, and sharded.py, which writes
it: the reading side they share, so the loaders need not import the writer (docs/architecture.md, "Layers")."""
from __future__ import annotations

import os

import torch

from megassm.training.checkpoint.errors import CheckpointError

__all__ = ["DCP_DIR", "LAYOUT", "dcp_metadata", "dcp_load", "read_layout", "read_canonical"]

DCP_DIR = "dcp"
LAYOUT = "layout.pt"


def _load_planner(targets: dict):
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class _ChunkLoadPlanner(DefaultLoadPlanner):
        """Reads into the given target chunks (views): per target, the saved chunks that overlap it."""

        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.state_dict, self.original_state_dict = {}, {}
            self.metadata, self.is_coordinator = metadata, is_coordinator

        def create_local_plan(self):
            reqs = []
            for key, pieces in targets.items():
                md = self.metadata.state_dict_metadata[key]
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in pieces]
                reqs += create_read_items_for_chunk_list(key, md, chunks)
            self.plan = LoadPlan(reqs)
            return self.plan

        def lookup_tensor(self, index):
            return targets[index.fqn][index.index][1]

    return _ChunkLoadPlanner()


def dcp_metadata(path: str):
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(os.path.join(path, DCP_DIR)).read_metadata()
    except (OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {DCP_DIR}/.metadata: {e}") from e


def dcp_load(targets: dict, path: str) -> None:
    """Fill `targets` ({key: [(offsets, tensor)]}) from the checkpoint at `path`; each rank on its own."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({}, storage_reader=FileSystemReader(os.path.join(path, DCP_DIR)), planner=_load_planner(targets),
                 no_dist=True)


def read_layout(path: str) -> dict:
    try:
        return torch.load(os.path.join(path, LAYOUT), map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {LAYOUT}: {e}") from e


def read_canonical(path: str, optim: bool = True) -> tuple[dict, dict | None]:
    """The canonical model and optimizer state dicts (optim.pt's format) of a sharded checkpoint, in this
    process (reads every chunk; CPU tensors)."""
    layout = read_layout(path)
    md = dcp_metadata(path)
    keys = ["model." + k for k in layout["model_keys"]]
    if optim:
        keys += [k for k in md.state_dict_metadata if k.startswith("optim.")]
    targets = {}
    for k in keys:
        if k not in md.state_dict_metadata:
            raise CheckpointError(f"checkpoint {path}: {DCP_DIR}/.metadata has no '{k}'")
        m = md.state_dict_metadata[k]
        t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        targets[k] = [((0,) * t.dim(), t)]
    dcp_load(targets, path)
    model_state = {k: targets["model." + k][0][1] for k in layout["model_keys"]}
    if not optim:
        return model_state, None
    state = {}
    for i, name in enumerate(layout["param_names"]):
        st = {sk: targets[f"optim.{name}.{sk}"][0][1] for sk in layout["state_keys"]
              if f"optim.{name}.{sk}" in targets}
        if st:
            state[i] = st
    if not layout["param_groups"]:  # saved without an optimizer
        return model_state, None
    return model_state, {"state": state, "param_groups": layout["param_groups"]}
