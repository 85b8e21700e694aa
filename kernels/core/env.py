"""The kernels' environment switches, parsed in one place without importing Triton, so a launcher can check
them all before any model or GPU work (`check()`, called by megassm-train) and the kernels read the same
values per call. Each bad value fails with a ValueError naming the variable and the value. docs/kernels.md
describes what each switch does."""
from __future__ import annotations

import os

KERNEL_MODES = ("auto", "triton", "torch")


def _get(name: str, default: str) -> str:
    return os.environ.get(name, default).strip().lower()


def _choice(name: str, default: str, allowed) -> str:
    value = _get(name, default) or default
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return value


def kernels_mode() -> str:
    """MEGASSM_KERNELS=auto|triton|torch ("reference" is torch; empty is auto)."""
    return _choice("MEGASSM_KERNELS", "auto", KERNEL_MODES + ("reference",)).replace("reference", "torch")


SSD_PRECISIONS = ("bf16", "split")  # MEGASSM_SSD_PRECISION's values, the default first


def ssd_precision() -> str:
    """MEGASSM_SSD_PRECISION=bf16|split (default bf16): the SSD's products for bf16 inputs (docs/kernels.md,
    "Precision": split keeps fp32-class parameter gradients at 1.11-1.17x the SSD time)."""
    return _choice("MEGASSM_SSD_PRECISION", SSD_PRECISIONS[0], SSD_PRECISIONS)


def ssd_state_segments():
    """MEGASSM_SSD_STATE_SEGMENTS=auto|k (default auto): "auto" or the positive integer k."""
    text = _get("MEGASSM_SSD_STATE_SEGMENTS", "auto")
    if text == "auto":
        return text
    k = int(text) if text.isdigit() else 0
    if k < 1:
        raise ValueError(f"MEGASSM_SSD_STATE_SEGMENTS={text!r}: expected a positive integer or auto")
    return k


def ssd_save_states() -> bool:
    """MEGASSM_SSD_SAVE_STATES=0|1 (default 0): keep the SSD forward's chunk states for the backward, which then
    skips recomputing them (memory for time; docs/kernels.md gives both)."""
    return _choice("MEGASSM_SSD_SAVE_STATES", "0", ("0", "1")) == "1"


SSD_DBC_SPLITS = ("1", "2", "4", "8")  # MEGASSM_SSD_DBC_SPLIT's values, the default first


def ssd_dbc_split() -> int:
    """MEGASSM_SSD_DBC_SPLIT=1|2|4|8 (default 1): programs that share the head loop of each dB / dC tile of the
    SSD backward (_dbc_kernel), their fp32 partials summed by torch. Opt-in until measured: at micro-batch 4 x
    2048 the kernel's grid is 64 programs for 132 SMs (docs/kernels.md, "The SSD backward's dB / dC")."""
    return int(_choice("MEGASSM_SSD_DBC_SPLIT", SSD_DBC_SPLITS[0], SSD_DBC_SPLITS))


def ssd_streams() -> bool:
    """MEGASSM_SSD_STREAMS=0|1 (default 1): run the SSD's kernels that do not depend on the chunk walks (C B^T,
    the backward's dCB) on a second CUDA stream, beside the walks."""
    return _choice("MEGASSM_SSD_STREAMS", "1", ("0", "1")) == "1"


CONV_BWD_MODES = ("two_pass_defer", "two_pass", "fused")  # MEGASSM_CONV_BWD's values, the default first
# (two_pass_defer: conv 99 -> 63 ms a mamba2-1.3b trainer step on an H100, +3.9% tokens/s, 2026-12-06; two_pass
# and fused kept as A/B baselines; docs/kernels.md "Conv and norms")


def conv_bwd() -> str:
    """MEGASSM_CONV_BWD=two_pass_defer|two_pass|fused (default two_pass_defer): the Triton conv backward as two
    kernels (dpre to an fp32 scratch, then dx from it) with pass 1's dweight / dbias reduction deferred to each
    program's end, the same with a reduction per block, or the single kernel that recomputes pre W times
    (docs/kernels.md, "Conv")."""
    return _choice("MEGASSM_CONV_BWD", CONV_BWD_MODES[0], CONV_BWD_MODES)


def triton_tune_log() -> bool:
    """MEGASSM_TRITON_TUNE_LOG=0|1 (default 0): print every autotuning decision of the Triton SSD kernels (each
    config's time and the pick, one JSON line on stderr)."""
    return _choice("MEGASSM_TRITON_TUNE_LOG", "0", ("0", "1")) == "1"


def check() -> None:
    """Parse every switch above; the first bad one raises. (MEGASSM_SSD_TILES is checked when the Triton SSD
    module is imported, against its table.)"""
    kernels_mode()
    ssd_precision()
    ssd_state_segments()
    ssd_save_states()
    ssd_streams()
    ssd_dbc_split()
    conv_bwd()
    triton_tune_log()
