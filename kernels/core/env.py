"""The kernels' switches, parsed in one place without importing Triton, so a launcher can check them all before
any model or GPU work (`check()`, called by megassm-train) and the kernels read the same values per call. Each
bad value fails with a ValueError naming the variable (or the config key) and the value. docs/kernels.md
describes what each switch does.

Each switch has a short name (SWITCHES), the key of the trainer config's `kernels:` section (docs/config.md):
megassm-train sets the variables from that section at start-up unless one is set already (the environment wins)
and records the values in effect in the run's config.yaml. The kernels themselves read only the variables: they
know nothing of the config."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

KERNEL_MODES = ("auto", "triton", "torch")
SSD_PRECISIONS = ("bf16", "split")  # MEGASSM_SSD_PRECISION's values, the default first
SSD_DBC_SPLITS = ("1", "2", "4", "8")  # MEGASSM_SSD_DBC_SPLIT's values, the default first
CONV_BWD_MODES = ("two_pass_defer", "two_pass", "fused")  # MEGASSM_CONV_BWD's values, the default first
# (two_pass_defer: conv 99 -> 63 ms a mamba2-1.3b trainer step on an H100, +3.9% tokens/s, 2026-12-06; two_pass
# and fused kept as A/B baselines; docs/kernels.md "Conv and norms")
# the entries of kernels/mamba2_ssd/triton_ssd_common.py TILES (named here so that a bad MEGASSM_SSD_TILES fails at
# start-up without importing Triton; tests/test_settings_recorded.py checks that the two agree)
SSD_TILE_NAMES = ("cb_bt", "states_bs", "states_bn", "scan_bt", "scan_bs", "scan_bk", "dstates_bt", "dstates_bn",
                  "dx_bs", "dx_bk", "dcb_bs", "dbc_bs", "dbc_bn")
_FLAG_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
               "off": False}


def _choice(allowed, aliases=None):
    def parse(label: str, text: str):
        if text not in allowed and text not in (aliases or {}):
            raise ValueError(f"{label}={text!r}: expected one of {', '.join(allowed)}")
        return (aliases or {}).get(text, text)
    return parse


def _flag01(label: str, text: str) -> bool:
    return _choice(("0", "1"))(label, text) == "1"


def _flag_words(label: str, text: str) -> bool:
    if text not in _FLAG_WORDS:
        raise ValueError(f"{label}={text!r}: expected 1 or 0 (true / false, yes / no, on / off)")
    return _FLAG_WORDS[text]


def _segments(label: str, text: str):
    if text == "auto":
        return text
    k = int(text) if text.isdigit() else 0
    if k < 1:
        raise ValueError(f"{label}={text!r}: expected a positive integer or auto")
    return k


def _tiles(label: str, text: str) -> dict:
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, val = (x.strip() for x in item.partition("="))
        if not sep or name not in SSD_TILE_NAMES:
            raise ValueError(f"{label}={text!r}: {item!r} is not NAME=VALUE with NAME one of {sorted(SSD_TILE_NAMES)}")
        v = int(val) if val.isdigit() else 0
        if v < 16 or v & (v - 1):
            raise ValueError(f"{label}={text!r}: {name}={val!r} must be a power of two >= 16")
        out[name] = v
    return out


@dataclass(frozen=True)
class Switch:
    key: str  # short name: the key of the trainer config's kernels: section
    var: str  # the environment variable the kernels read
    default: str  # the text of the default (also what an empty variable means)
    parse: Callable[[str, str], Any]  # (label, stripped lower-case text) -> value, or ValueError naming both
    record: Callable[[Any], Any] = lambda v: v  # parsed value -> the value as the config records it

    def value(self, text: str | None, label: str | None = None):
        """The parsed value of `text` (None or empty: the default); errors name `label` (default: the variable)."""
        text = (text or "").strip().lower() or self.default
        return self.parse(label or self.var, text)

    def read(self):
        """The value in effect: the variable's, else the default."""
        return self.value(os.environ.get(self.var))


SWITCHES = {s.key: s for s in (
    # auto: Triton for CUDA tensors when triton imports, the PyTorch reference otherwise | triton | torch
    # ("reference" is torch)
    Switch("backend", "MEGASSM_KERNELS", "auto", _choice(KERNEL_MODES, {"reference": "torch"})),
    # the SSD's products for bf16 inputs (docs/kernels.md, "Precision": split keeps fp32-class parameter
    # gradients at 1.11-1.17x the SSD time)
    Switch("ssd_precision", "MEGASSM_SSD_PRECISION", SSD_PRECISIONS[0], _choice(SSD_PRECISIONS)),
    # "auto" or the positive integer k: the chunk walks as k parallel segments
    Switch("ssd_state_segments", "MEGASSM_SSD_STATE_SEGMENTS", "auto", _segments, str),
    # keep the SSD forward's chunk states for the backward, which then skips recomputing them (memory for time)
    Switch("ssd_save_states", "MEGASSM_SSD_SAVE_STATES", "0", _flag01),
    # programs that share the head loop of each dB / dC tile of the SSD backward (_dbc_kernel), their fp32
    # partials summed by torch. Opt-in until measured: at micro-batch 4 x 2048 the kernel's grid is 64 programs
    # for 132 SMs (docs/kernels.md, "The SSD backward's dB / dC")
    Switch("ssd_dbc_split", "MEGASSM_SSD_DBC_SPLIT", SSD_DBC_SPLITS[0], _choice(SSD_DBC_SPLITS), int),
    # the SSD's kernels that do not depend on the chunk walks (C B^T, the backward's dCB) on a second CUDA stream
    Switch("ssd_streams", "MEGASSM_SSD_STREAMS", "1", _flag01),
    # the Triton conv backward: two kernels with pass 1's dweight / dbias reduction deferred to each program's
    # end, the same with a reduction per block, or the single kernel that recomputes pre W times
    Switch("conv_bwd", "MEGASSM_CONV_BWD", CONV_BWD_MODES[0], _choice(CONV_BWD_MODES)),
    # tune num_warps / num_stages per shape on first use (0: each kernel's first config; the GPU tests)
    Switch("autotune", "MEGASSM_TRITON_AUTOTUNE", "1", _flag_words),
    # print every autotuning decision of the Triton SSD kernels (one JSON line on stderr)
    Switch("tune_log", "MEGASSM_TRITON_TUNE_LOG", "0", _flag01),
    # "NAME=VALUE,...": override entries of the Triton SSD's tile table (tuning on another GPU)
    Switch("ssd_tiles", "MEGASSM_SSD_TILES", "", _tiles, lambda d: ",".join(f"{k}={v}" for k, v in d.items())),
)}


def to_text(key: str, value) -> str:
    """A config value of kernels.<key> as its variable's text (booleans as 1 / 0)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def kernels_mode() -> str:
    """MEGASSM_KERNELS=auto|triton|torch ("reference" is torch; empty is auto)."""
    return SWITCHES["backend"].read()


def ssd_precision() -> str:
    """MEGASSM_SSD_PRECISION=bf16|split (default bf16): the SSD's products for bf16 inputs (docs/kernels.md,
    "Precision": split keeps fp32-class parameter gradients at 1.11-1.17x the SSD time)."""
    return SWITCHES["ssd_precision"].read()


def ssd_state_segments():
    """MEGASSM_SSD_STATE_SEGMENTS=auto|k (default auto): "auto" or the positive integer k."""
    return SWITCHES["ssd_state_segments"].read()


def ssd_save_states() -> bool:
    """MEGASSM_SSD_SAVE_STATES=0|1 (default 0): keep the SSD forward's chunk states for the backward, which then
    skips recomputing them (memory for time; docs/kernels.md gives both)."""
    return SWITCHES["ssd_save_states"].read()


def ssd_dbc_split() -> int:
    """MEGASSM_SSD_DBC_SPLIT=1|2|4|8 (default 1): programs that share the head loop of each dB / dC tile of the
    SSD backward (_dbc_kernel), their fp32 partials summed by torch. Opt-in until measured: at micro-batch 4 x
    2048 the kernel's grid is 64 programs for 132 SMs (docs/kernels.md, "The SSD backward's dB / dC")."""
    return int(SWITCHES["ssd_dbc_split"].read())


def ssd_streams() -> bool:
    """MEGASSM_SSD_STREAMS=0|1 (default 1): run the SSD's kernels that do not depend on the chunk walks (C B^T,
    the backward's dCB) on a second CUDA stream, beside the walks."""
    return SWITCHES["ssd_streams"].read()


def conv_bwd() -> str:
    """MEGASSM_CONV_BWD=two_pass_defer|two_pass|fused (default two_pass_defer): the Triton conv backward as two
    kernels (dpre to an fp32 scratch, then dx from it) with pass 1's dweight / dbias reduction deferred to each
    program's end, the same with a reduction per block, or the single kernel that recomputes pre W times
    (docs/kernels.md, "Conv")."""
    return SWITCHES["conv_bwd"].read()


def triton_autotune() -> bool:
    """MEGASSM_TRITON_AUTOTUNE=1|0 (default 1; also true / false, yes / no, on / off): tune num_warps /
    num_stages per shape on first use, else launch each kernel's first config (the GPU tests: compiling every
    config of every variant costs minutes). kernels/mamba2_ssd/triton_ssd_common.py reads it when imported."""
    return SWITCHES["autotune"].read()


def triton_tune_log() -> bool:
    """MEGASSM_TRITON_TUNE_LOG=0|1 (default 0): print every autotuning decision of the Triton SSD kernels (each
    config's time and the pick, one JSON line on stderr)."""
    return SWITCHES["tune_log"].read()


def ssd_tiles() -> dict:
    """MEGASSM_SSD_TILES="dx_bs=64,dbc_bs=64" (default none): {entry: tile} overriding
    kernels/mamba2_ssd/triton_ssd_common.py TILES, each a power of two >= 16. ssd_common applies it when imported."""
    return SWITCHES["ssd_tiles"].read()


def check() -> None:
    """Parse every switch above; the first bad one raises."""
    for switch in SWITCHES.values():
        switch.read()
