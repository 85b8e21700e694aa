"""What a run is checked against before any model is built or a GPU is touched: the layouts this build
refuses (`check_supported`, also the dry run's), the device and the autocast dtype a config asks for."""
from __future__ import annotations

import logging
import os

import torch

from megassm.config import Config, ConfigError, data_parallel_size, world_size
from megassm.parallel.engines import check_engine

log = logging.getLogger("megassm.train")

__all__ = ["check_supported", "pick_device", "autocast_dtype"]


def check_supported(cfg: Config, device: torch.device | None = None) -> None:
    """Refuse layouts this build cannot run yet, before any model is built or a GPU is touched. `device`: the one
    the job will run on (default: what train.device picks here; the dry run passes the GPU a launched job has)."""
    p = cfg.parallel
    device = pick_device(cfg) if device is None else device
    if p.pp > 1 and p.cp > 1:
        raise ConfigError(f"parallel.pp={p.pp} with parallel.cp={p.cp}: pipeline parallelism combined with context "
                          "parallelism is not built; set one of them to 1 (PP x TP x DP is)")
    if p.sp and p.tp == 1:
        raise ConfigError("parallel.sp=true needs parallel.tp > 1 (sequence parallelism shards over the TP group)")
    if p.tp_overlap and p.tp == 1:
        raise ConfigError("parallel.tp_overlap=true needs parallel.tp > 1 (it overlaps the tensor-parallel "
                          "collectives with compute)")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size(cfg) != 1 and launched != world_size(cfg):
        raise ConfigError(
            f"parallel.tp={p.tp} with world size {world_size(cfg)} but WORLD_SIZE={os.environ.get('WORLD_SIZE', '1')}: "
            "launch one process per rank with torchrun (torchrun --nproc_per_node N -m megassm.train ...)"
        )
    if p.world_size is not None and launched != p.world_size:  # e.g. 1 in the config, 2 processes launched
        raise ConfigError(f"parallel.world_size={p.world_size}, but the launcher started {launched} processes "
                          f"(WORLD_SIZE={launched}): set parallel.world_size={launched}, or leave it unset to follow "
                          "the launcher")
    check_engine(cfg)  # DDP / FSDP2 / DeepSpeed layouts (parallel/engines.py)
    if cfg.run.wandb != "off" and not _importable("wandb"):  # found, not imported: run.wandb=off never imports it
        raise ConfigError(f"run.wandb={cfg.run.wandb} needs the wandb package: pip install wandb "
                          "(or pip install 'megassm[wandb]'), or set run.wandb=off")
    if cfg.train.spike_action == "skip" and p.engine == "deepspeed" and data_parallel_size(cfg) > 1:
        raise ConfigError("train.spike_action=skip with parallel.engine=deepspeed: DeepSpeed's engine.step() reduces, "
                          "clips and steps in one call and its gradient norm exists only after it, so a spiking "
                          "step cannot be declined; use train.spike_action=rollback (the last checkpoint is "
                          "restored) or parallel.engine=ddp / fsdp2")
    if cfg.train.bptt_windows != 1 and not cfg.train.bptt:
        raise ConfigError(f"train.bptt_windows={cfg.train.bptt_windows} needs train.bptt=true")
    if cfg.train.bptt and p.pp > 1 and cfg.train.bptt_windows > 1:  # BPTT: training/bptt.py, docs/bptt.md
        raise ConfigError(
            f"train.bptt_windows={cfg.train.bptt_windows} with parallel.pp={p.pp}: backpropagating through several "
            "windows would need one graph across several pipeline schedule runs; pipeline stages carry state with "
            "truncated BPTT (train.bptt_windows=1)"
        )
    if cfg.train.compile:
        _check_compile(cfg)
    if cfg.train.cuda_graph:
        _check_cuda_graph(cfg)
    if cfg.train.cast_weights_once:
        _check_cast_weights_once(cfg, device)
    if cfg.train.fp8:
        _check_fp8(cfg, device)
    _check_group_builder(cfg)
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible (use train.device=auto or cpu)")
    if cfg.train.precision == "bf16" and device.type == "cpu":
        log.warning("train.precision=bf16 on CPU: autocast to bf16 on CPU is slow; fp32 is the CPU default")


def _check_compile(cfg: Config) -> None:
    """train.compile=true (training/compile.py): blocks without collectives inside them, under the engines whose
    hooks sit outside the block's forward; the combinations not tested are refused rather than tried."""
    p, t = cfg.parallel, cfg.train
    why = None
    if p.tp > 1:
        why = (f"parallel.tp={p.tp}: the TP plan's autograd functions (parallel/tp.py) run collectives inside the "
               "block, which torch.compile cannot trace; leave train.compile off with TP")
    elif p.cp > 1:
        why = (f"parallel.cp={p.cp}: the blocks pass chunk states between ranks inside their forward "
               "(parallel/cp.py), which torch.compile cannot trace; leave train.compile off with CP")
    elif p.pp > 1:
        why = f"parallel.pp={p.pp}: not built for pipeline stages (untested); leave train.compile off with PP"
    elif t.cuda_graph:
        why = "train.cuda_graph=true: pick one (both remove the glue's launch overhead; graphs are measured)"
    elif t.fp8:
        why = "train.fp8=true: the FP8 Linears' weight path is not built for compilation (untested)"
    elif t.cast_weights_once:
        why = "train.cast_weights_once=true: its weight copies' hooks are not built for compilation (untested)"
    elif p.engine == "deepspeed" and data_parallel_size(cfg) > 1:
        why = "parallel.engine=deepspeed: not built (untested); ddp, zero_stage=1 and fsdp2 take it"
    if why is not None:
        raise ConfigError(f"train.compile=true: {why}")


def _check_cast_weights_once(cfg: Config, device: torch.device) -> None:
    """train.cast_weights_once=true (training/weight_cache.py): bf16 autocast, the ddp engine, no PP or BPTT, and
    with several DP ranks only under train.cuda_graph (eager torch DDP's reducer hooks wait for gradients on the
    parameters themselves; after the graphs' replays the engine averages them instead)."""
    p, t = cfg.parallel, cfg.train
    why = None
    if autocast_dtype(cfg, device) is not torch.bfloat16:
        why = (f"train.precision={t.precision} on {device.type}: the weights are cast for bf16 autocast "
               "(train.precision=bf16, or auto on a GPU)")
    elif p.engine != "ddp" and data_parallel_size(cfg) > 1:
        why = f"parallel.engine={p.engine}: FSDP2 and DeepSpeed keep bf16 weights of their own; use parallel.engine=ddp"
    elif p.pp > 1:
        why = f"parallel.pp={p.pp}: not built for pipeline stages"
    elif t.bptt:
        why = "train.bptt=true: not built for the windows' loop"
    elif data_parallel_size(cfg) > 1 and not t.cuda_graph:
        why = (f"{data_parallel_size(cfg)} data-parallel ranks without train.cuda_graph: torch DDP's hooks wait for "
               "gradients on the fp32 parameters, which now come from the copies' hooks; set train.cuda_graph=true "
               "(the gradients are then averaged after the replays) or leave this off")
    if why is not None:
        raise ConfigError(f"train.cast_weights_once=true: {why}")


def _check_fp8(cfg: Config, device: torch.device) -> None:
    """train.fp8=true (training/fp8.py): bf16 autocast, not tp_overlap or FSDP2 x TP, no cast_weights_once, not
    DeepSpeed; on CUDA a GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell)."""
    p, t = cfg.parallel, cfg.train
    why = None
    if autocast_dtype(cfg, device) is not torch.bfloat16:
        why = (f"train.precision={t.precision} on {device.type}: FP8 projections run inside bf16 autocast "
               "(train.precision=bf16, or auto on a GPU)")
    elif p.tp > 1 and p.tp_overlap:
        why = ("parallel.tp_overlap=true: its column-parallel autograd function (parallel/layers.py) is not built "
               "for FP8; set parallel.tp_overlap=false")
    elif p.tp > 1 and p.engine == "fsdp2":
        why = f"parallel.engine=fsdp2 with parallel.tp={p.tp} (FSDP2 x TP): not built (tp with ddp / zero_stage=1 is)"
    elif t.cast_weights_once:
        why = "train.cast_weights_once=true: both replace the Linears' weight path; pick one"
    elif p.engine == "deepspeed":
        why = "parallel.engine=deepspeed: not built (ddp, zero_stage=1 and fsdp2 are)"
    elif device.type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            why = (f"{torch.cuda.get_device_name(device)} (compute capability {cap[0]}.{cap[1]}) has no FP8 tensor "
                   "cores (8.9 or newer: Ada, Hopper, Blackwell)")
    if why is not None:
        raise ConfigError(f"train.fp8=true: {why}")


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # sys.modules[name] is None: importing it fails
        return False


def _check_group_builder(cfg: Config) -> None:
    """MEGASSM_PROCESS_GROUPS (parallel/state.py): a known value, and megatron-core installed when it is asked
    for by a multi-process run."""
    import importlib.util

    from megassm.parallel.state import group_builder

    try:
        builder = group_builder()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if builder == "megatron" and world_size(cfg) > 1 and importlib.util.find_spec("megatron") is None:
        raise ConfigError("MEGASSM_PROCESS_GROUPS=megatron, but megatron-core is not installed "
                          "(pip install megatron-core, or MEGASSM_PROCESS_GROUPS=auto)")


# torch reads these as booleans: "1", "true", ... (NCCL_BLOCKING_WAIT is the deprecated name)
_BLOCKING_WAIT = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "y", "on")


def _check_cuda_graph(cfg: Config) -> None:
    """train.cuda_graph=true: refuse what a captured micro-batch cannot hold (training/cuda_graph.py): pipeline
    parallelism, sharding engines' backward hooks, BPTT, blocks whose forward reads values on the host (COFFEE,
    B'MOJO with the packed batches' document resets), and NCCL's blocking wait under TP or CP. Tensor (+ SP) and
    context parallelism are taken: their collectives are captured in the graph; TP's replicated gradients' sum,
    CP's gradient sum and the DP all-reduce run after the replays. Activation checkpointing is taken (the
    recomputation is captured with the backward). Attention is taken: under the graph it builds its document
    mask on the device for every batch."""
    from megassm.config import blocks_of
    from megassm.training.cuda_graph import GRAPH_SAFE_LETTERS

    p, t = cfg.parallel, cfg.train
    why = None
    if p.pp > 1:
        why = (f"parallel.pp={p.pp}: the pipeline schedule runs each micro-batch's forward and backward itself, "
               "with point-to-point sends between stages, not as the one call a graph captures; tensor "
               "parallelism (+ SP), context parallelism and data parallelism (parallel.engine=ddp) combine with it")
    elif p.engine != "ddp" and data_parallel_size(cfg) > 1:
        why = f"parallel.engine={p.engine}: FSDP2 and DeepSpeed hook the backward; use parallel.engine=ddp"
    elif t.bptt:
        why = "train.bptt=true: the carried state changes between windows"
    elif (p.tp > 1 or p.cp > 1) and any(_env_flag(v) for v in _BLOCKING_WAIT):
        name = next(v for v in _BLOCKING_WAIT if _env_flag(v))
        which = " ".join(f"parallel.{k}={v}" for k, v in (("tp", p.tp), ("cp", p.cp)) if v > 1)
        why = (f"{name}={os.environ[name]} with {which}: every collective would wait for its "
               "completion on the host, which a capture cannot do (unset it; parallel.timeout_s still bounds "
               "the eager collectives after the replays)")
    else:
        bad = sorted(set(blocks_of(cfg.model.pattern)) - set(GRAPH_SAFE_LETTERS))
        if bad:
            why = (f"model.pattern='{cfg.model.pattern}' has block(s) {', '.join(repr(c) for c in bad)}: their forward "
                   "reads values on the host (COFFEE's solver tests values, B'MOJO counts its memory groups per "
                   "batch of packed documents); graph-safe blocks: "
                   + ", ".join(f"{k} {v}" for k, v in GRAPH_SAFE_LETTERS.items()))
    if why is not None:
        raise ConfigError(f"train.cuda_graph=true: {why}")


def pick_device(cfg: Config) -> torch.device:
    if cfg.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.train.device)


def autocast_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """None means plain fp32; otherwise autocast to this dtype (parameters stay fp32 masters)."""
    prec = cfg.train.precision
    if prec == "auto":
        prec = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if prec == "bf16" else None
