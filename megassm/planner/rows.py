"""The measured rows of docs/benchmarks.md the planner is validated against (docs/planner.md "Validation"):
every one-GPU and multi-GPU training row measured on H100 80GB with the trainer as it is, as the document gives it.
The calibration is measured apart (megassm-plan calibrate, block micro-benchmarks): nothing here feeds it.

A row: the config, the overrides that make its layout (world size, batch, engine, ...), whether its collectives
ran (`comm`: False for a rank measured alone under torch's fake process group), the measured tokens/s per GPU,
and where it comes from. Rows left out, with the reason, are in LEFT_OUT.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Row", "ROWS", "LEFT_OUT"]

S1 = "docs/benchmarks.md One-GPU training step (one H100 80GB, 2026-12-06)"
STP = "docs/benchmarks.md A TP rank's compute alone, on one H100 80GB (2026-12-06)"
S7 = "docs/benchmarks.md Training layouts at 7B (4 x H100 80GB, NCCL)"
SCP = "docs/benchmarks.md A CP rank's compute alone under CUDA graphs, one H100 80GB (2026-12-06)"

ONE_GPU = ["parallel.world_size=1", "train.seq_len=2048", "train.global_batch=16", "train.cuda_graph=true"]
TP_ALONE = ["train.seq_len=4096", "train.cuda_graph=true"]
SEVEN = ["parallel.world_size=4", "train.seq_len=4096", "train.micro_batch=1", "parallel.gpus_per_node=4"]
CP_ALONE = ["train.micro_batch=1", "train.global_batch=1", "train.cuda_graph=true", "train.activation_checkpointing=true"]


@dataclass(frozen=True)
class Row:
    name: str
    config: str
    overrides: tuple
    measured: float  # tokens/s per GPU
    source: str
    comm: bool = True
    date: str = ""
    notes: str = ""
    best_of: str = field(default="", compare=False)  # a group of layouts whose best the planner must rank first


def _r(name, config, overrides, measured, source, **kw):
    return Row(name, config, tuple(overrides), float(measured), source, **kw)


ROWS = [
    # one GPU, CUDA graphs, seq 2048, 16 sequences a step
    _r("mamba2-1.3b, 1 GPU, micro-batch 8", "configs/mamba2-1.3b.yaml", ONE_GPU + ["train.micro_batch=8"], 46648, S1,
       comm=False, date="2026-12-06"),
    _r("mamba2-1.3b, 1 GPU, micro-batch 4", "configs/mamba2-1.3b.yaml", ONE_GPU + ["train.micro_batch=4"], 43653, S1,
       comm=False, date="2026-12-06"),
    _r("mamba2-1.3b, 1 GPU, micro-batch 8, cast_weights_once", "configs/mamba2-1.3b.yaml",
       ONE_GPU + ["train.micro_batch=8", "train.cast_weights_once=true"], 46935, S1, comm=False, date="2026-12-06",
       notes="the option's +0.6% is not in the model"),
    _r("hybrid-1.3b, 1 GPU, micro-batch 8", "configs/hybrid-1.3b.yaml", ONE_GPU + ["train.micro_batch=8"], 55778, S1,
       comm=False, date="2026-12-06"),
    _r("hybrid-1.3b, 1 GPU, micro-batch 4", "configs/hybrid-1.3b.yaml", ONE_GPU + ["train.micro_batch=4"], 53575, S1,
       comm=False, date="2026-12-06"),
    # a TP rank alone (fake world of 4), graphs, one micro-batch a step
    *[_r(f"mamba2-2.7b, TP {tp}{' + SP' if sp else ''} rank alone, micro-batch {mb}", "configs/mamba2-2.7b.yaml",
         TP_ALONE + [f"parallel.world_size={tp}", f"parallel.tp={tp}", f"parallel.sp={'true' if sp else 'false'}",
                     f"train.micro_batch={mb}", f"train.global_batch={mb}"], v, STP, comm=False, date="2026-12-06")
      for tp, sp, mb, v in [(1, False, 1, 17638), (2, False, 1, 15869), (2, True, 1, 16458), (4, False, 1, 13198),
                            (4, True, 1, 13866), (2, False, 4, 22623), (2, True, 4, 23164), (4, False, 4, 18951),
                            (4, True, 4, 20348)]],
    *[_r(f"hybrid-7b, TP {tp}{' + SP' if sp else ''} rank alone, micro-batch {mb}", "configs/hybrid-7b.yaml",
         TP_ALONE + [f"parallel.world_size={tp}", f"parallel.tp={tp}", f"parallel.sp={'true' if sp else 'false'}",
                     f"train.micro_batch={mb}", f"train.global_batch={mb}"], v, STP, comm=False, date="2026-12-06")
      for tp, sp, mb, v in [(2, True, 1, 10206), (4, True, 1, 9334), (4, False, 2, 11016), (4, True, 2, 11740)]],
    # a CP rank alone (the last of 4, fake world) against CP 1 at a quarter of the length, graphs + checkpointing
    _r("mamba2-1.3b, CP 4 rank alone, 64K tokens", "configs/mamba2-1.3b.yaml",
       CP_ALONE + ["parallel.world_size=4", "parallel.cp=4", "train.seq_len=65536"], 16384 / 0.4958, SCP, comm=False,
       date="2026-12-06"),
    _r("mamba2-1.3b, CP 1, 16K tokens", "configs/mamba2-1.3b.yaml",
       CP_ALONE + ["parallel.world_size=1", "train.seq_len=16384"], 16384 / 0.4514, SCP, comm=False,
       date="2026-12-06"),
    _r("mamba2-1.3b, CP 4 rank alone, 128K tokens", "configs/mamba2-1.3b.yaml",
       CP_ALONE + ["parallel.world_size=4", "parallel.cp=4", "train.seq_len=131072"], 32768 / 0.9065, SCP,
       comm=False, date="2026-12-06"),
    _r("mamba2-1.3b, CP 1, 32K tokens", "configs/mamba2-1.3b.yaml",
       CP_ALONE + ["parallel.world_size=1", "train.seq_len=32768"], 32768 / 0.8716, SCP, comm=False,
       date="2026-12-06"),
    # 7B on 4 x H100 over NCCL
    _r("hybrid-7b, FSDP2 DP 4, fp32 sums, 32 micro-batches", "configs/hybrid-7b.yaml",
       SEVEN + ["parallel.engine=fsdp2", "train.global_batch=128"], 9996, S7, date="2026-11-27", best_of="hybrid-7b 4 x H100"),
    _r("hybrid-7b, FSDP2 DP 4, bf16 sums, 32 micro-batches", "configs/hybrid-7b.yaml",
       SEVEN + ["parallel.engine=fsdp2", "parallel.fsdp_reduce_dtype=bf16", "train.global_batch=128"], 10428, S7,
       date="2026-11-27", best_of="hybrid-7b 4 x H100"),
    _r("hybrid-7b, FSDP2 DP 4, 4 micro-batches", "configs/hybrid-7b.yaml",
       SEVEN + ["parallel.engine=fsdp2", "train.global_batch=16"], 10070, S7, date="2026-11-27"),
    *[_r(f"hybrid-7b, TP 2 x ZeRO-1 DP 2, graphs, {a} micro-batches", "configs/hybrid-7b.yaml",
         SEVEN + ["parallel.tp=2", "parallel.zero_stage=1", "train.cuda_graph=true", f"train.global_batch={2 * a}"], v,
         S7, date="2026-11-28", best_of="hybrid-7b 4 x H100" if a == 16 else "",
         notes="measured with the ZeRO-1 of then (1.5x an all-reduce's bytes); predicted with the current distributed "
               "optimizer (1x)") for a, v in [(16, 8822), (8, 8527), (4, 7910)]],
    _r("hybrid-7b, TP 2 x ZeRO-1 DP 2, eager, 4 micro-batches", "configs/hybrid-7b.yaml",
       SEVEN + ["parallel.tp=2", "parallel.zero_stage=1", "train.global_batch=8"], 6301, S7, date="2026-11-28",
       notes="7,141 on 2026-11-27 on another machine; ZeRO-1 of then"),
    _r("hybrid-7b, TP 4, graphs, 4 micro-batches", "configs/hybrid-7b.yaml",
       SEVEN + ["parallel.tp=4", "train.cuda_graph=true", "train.global_batch=4"], 7151, S7, date="2026-11-28",
       best_of="hybrid-7b 4 x H100"),
    _r("hybrid-7b, FSDP2 x TP 2, eager, 4 micro-batches", "configs/hybrid-7b.yaml",
       SEVEN + ["parallel.engine=fsdp2", "parallel.tp=2", "train.global_batch=8"], 4258, S7, date="2026-11-28"),
    _r("hybrid-7b, DeepSpeed ZeRO-3 DP 4, 4 micro-batches", "configs/hybrid-7b.yaml",
       SEVEN + ["parallel.engine=deepspeed", "parallel.zero_stage=3", "train.global_batch=16"], 4301, S7,
       date="2026-11-27"),
    _r("mamba2-7b, FSDP2 DP 4, reshard block, 4 micro-batches", "configs/mamba2-7b.yaml",
       SEVEN + ["parallel.engine=fsdp2", "parallel.fsdp_reshard=block", "train.global_batch=16"], 5917, S7,
       date="2026-11-27"),
    _r("hybrid-7b, TP 4, eager, 8 micro-batches", "configs/hybrid-7b.yaml",
       SEVEN + ["parallel.tp=4", "train.global_batch=8"], 3473, S7, date="2026-11-27"),
]

LEFT_OUT = {
    "train.fp8 rows (one GPU)": "FP8 projections are not in the calibration",
    "every 4 x H200 row": "no H200 calibration file (the H200's faster memory changes every kernel's time)",
    "DeepSpeed ZeRO-1 rows of 2026-11-27": "not valid: the boundary bug (docs/benchmarks.md)",
    "PP 2 x ZeRO-1 on 4 x H100": "no step finished in 90 s (docs/benchmarks.md)",
    "the peers (mamba_ssm, the Llama-style Transformer)": "not this trainer",
}
