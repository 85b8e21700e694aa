"""The live state a checkpoint holds beside the weights: the single-device module inside its wrappers, and the
random number generators (Python, numpy, torch CPU and CUDA) captured and restored exactly."""
from __future__ import annotations

import logging
import random

import numpy as np
import torch

log = logging.getLogger("megassm.checkpoint")

__all__ = ["unwrap_model", "capture_rng_state", "restore_rng_state"]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The single-device module inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) or (
            type(model).__name__ in ("DistributedDataParallel", "DataParallel") and hasattr(model, "module")
        ):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
    return model


# ----------------------------------------------------------------------------------------------------
# RNG
# ----------------------------------------------------------------------------------------------------


def capture_rng_state() -> dict:
    """Python `random`, numpy's global RNG, torch CPU, and torch CUDA of the current device (None without
    CUDA). Only plain types and tensors, so the file loads with torch.load(weights_only=True)."""
    version, internal, gauss = random.getstate()
    npst = np.random.get_state(legacy=False)
    state = {
        "python": [version, list(internal), gauss],
        "numpy": {
            "bit_generator": npst["bit_generator"],
            "key": torch.from_numpy(npst["state"]["key"].astype(np.int64)),
            "pos": int(npst["state"]["pos"]),
            "has_gauss": int(npst["has_gauss"]),
            "gauss": float(npst["gauss"]),
        },
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": None,
        "cuda_device": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.cuda.current_device()
        state["torch_cuda"] = torch.cuda.get_rng_state(dev)
        state["cuda_device"] = dev
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of capture_rng_state. The CUDA state goes to the current device (each process owns one);
    a checkpoint saved with CUDA and restored without it (or the reverse) restores the rest and warns."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state({
        "bit_generator": n["bit_generator"],
        "state": {"key": n["key"].numpy().astype(np.uint32), "pos": int(n["pos"])},
        "has_gauss": int(n["has_gauss"]),
        "gauss": float(n["gauss"]),
    })
    torch.set_rng_state(state["torch_cpu"])
    cuda = state.get("torch_cuda")
    if cuda is not None:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda, torch.cuda.current_device())
        else:
            log.warning("checkpoint has a CUDA RNG state but CUDA is not available; not restored")
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        log.warning("checkpoint has no CUDA RNG state (saved without CUDA); the CUDA RNG is not restored")
