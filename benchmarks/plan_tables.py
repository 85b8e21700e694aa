"""The planner's tables of docs/planner.md, from the committed calibration (no GPU):
  --beyond        the predicted best layout of mamba2-1.3b, hybrid-1.3b, mamba2-7b and hybrid-7b on 1 to 128 nodes
                  of 8 x H100, with 400 Gb/s InfiniBand and with 100 Gb/s Ethernet per GPU;
  --before-runs   the predictions of the multi-GPU rows still to be measured (written down before the runs);
  --recipes       each recipe's predicted line (configs/recipes/*.yaml); with --write, rewritten in the files.
Markdown on stdout; --calibration FILE replaces the committed H100 calibration.

    python benchmarks/plan_tables.py --beyond [--nodes 1 2 4 8 32 128]
    python benchmarks/plan_tables.py --before-runs
    python benchmarks/plan_tables.py --recipes --write
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megassm.config import load_config  # noqa: E402
from megassm.planner.costs import Calibration, predict  # noqa: E402
from megassm.planner.plan import default_calibration, plan  # noqa: E402
from megassm.planner.validate import class_errors, layout_class, validate  # noqa: E402

MODELS = {  # config, global batch (sequences), sequence: ~1M tokens a step
    "mamba2-1.3b": ("configs/mamba2-1.3b.yaml", 512, 2048),
    "hybrid-1.3b": ("configs/hybrid-1.3b.yaml", 512, 2048),
    "mamba2-7b": ("configs/mamba2-7b.yaml", 256, 4096),
    "hybrid-7b": ("configs/hybrid-7b.yaml", 256, 4096),
}


def beyond(nodes_list: list[int], cal: Calibration) -> None:
    print("| model | nodes x 8 H100 | network | predicted best layout | tokens/s per GPU | MFU | exposed comm "
          "inside / across (s a step) | memory |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (path, gb, seq) in MODELS.items():
        for nodes in nodes_list:
            world = nodes * 8
            batch = max(gb, world)  # at least one sequence per GPU
            for net in ("ib400", "eth100"):
                if nodes == 1 and net == "eth100":
                    continue  # one node: no network
                cfg = load_config(os.path.join(ROOT, path), ["data.builtin=stdlib", f"parallel.world_size={world}",
                                                             f"train.global_batch={batch}",
                                                             f"train.seq_len={seq}"], validate_config=False)
                rows = plan(cfg, nodes, 8, "h100-80gb", net, cal)
                if not rows:
                    print(f"| {name} | {nodes} | {net} | none fits | | | | |")
                    continue
                b = rows[0]
                lay = " ".join(o for o in b["overrides"] if not o.startswith(("parallel.world_size",
                                                                              "parallel.gpus_per_node")))
                gbs = "" if batch == gb else f" (global batch {batch})"
                print(f"| {name} | {nodes}{gbs} | {net} | `{lay or 'the config as is'}` | "
                      f"{b['tokens_per_s_per_gpu']:,.0f} | {100 * (b['mfu'] or 0):.1f}% | "
                      f"{b['exposed_inside_s']:.3f} / {b['exposed_across_s']:.3f} | {b['needed_gib']:.0f} GiB |",
                      flush=True)


# the rows of the multi-GPU run still to be measured (the multi-GPU issue), each a layout on 4 x H100 80GB
BEFORE = [
    ("hybrid-7b, FSDP2 DP 4, fp32 sums, 0.5M tokens", "configs/hybrid-7b.yaml",
     ["parallel.engine=fsdp2", "train.global_batch=128"]),
    ("hybrid-7b, HSDP (shard 2 x replicate 2), 0.5M tokens", "configs/hybrid-7b.yaml",
     ["parallel.engine=fsdp2", "parallel.shard_size=2", "train.global_batch=128"]),
    ("hybrid-7b, FSDP2 step sync, 0.5M tokens", "configs/hybrid-7b.yaml",
     ["parallel.engine=fsdp2", "parallel.fsdp_grad_sync=step", "train.global_batch=128"]),
    ("hybrid-7b, TP 2 + SP x distributed optimizer DP 2, graphs, 0.5M tokens", "configs/hybrid-7b.yaml",
     ["parallel.tp=2", "parallel.sp=true", "parallel.zero_stage=1", "train.cuda_graph=true", "train.global_batch=128"]),
    ("mamba2-7b, FSDP2 DP 4, 0.5M tokens", "configs/mamba2-7b.yaml",
     ["parallel.engine=fsdp2", "parallel.fsdp_reshard=block", "train.global_batch=128"]),
    ("mamba2-2.7b, TP 1, graphs, micro-batch 1 x 4096", "configs/mamba2-2.7b.yaml",
     ["parallel.world_size=1", "train.cuda_graph=true", "train.micro_batch=1", "train.seq_len=4096",
      "train.global_batch=4"]),
    ("mamba2-2.7b, TP 2, graphs", "configs/mamba2-2.7b.yaml",
     ["parallel.world_size=2", "parallel.tp=2", "train.cuda_graph=true", "train.micro_batch=1", "train.seq_len=4096",
      "train.global_batch=4"]),
    ("mamba2-2.7b, TP 2 + SP, graphs", "configs/mamba2-2.7b.yaml",
     ["parallel.world_size=2", "parallel.tp=2", "parallel.sp=true", "train.cuda_graph=true", "train.micro_batch=1",
      "train.seq_len=4096", "train.global_batch=4"]),
    ("mamba2-2.7b, TP 4, graphs", "configs/mamba2-2.7b.yaml",
     ["parallel.tp=4", "train.cuda_graph=true", "train.micro_batch=1", "train.seq_len=4096", "train.global_batch=4"]),
    ("mamba2-2.7b, TP 4 + SP, graphs", "configs/mamba2-2.7b.yaml",
     ["parallel.tp=4", "parallel.sp=true", "train.cuda_graph=true", "train.micro_batch=1", "train.seq_len=4096",
      "train.global_batch=4"]),
    ("mamba2-1.3b, CP 4, 64K tokens, graphs + checkpointing", "configs/mamba2-1.3b.yaml",
     ["parallel.cp=4", "train.seq_len=65536", "train.micro_batch=1", "train.global_batch=1", "train.cuda_graph=true",
      "train.activation_checkpointing=true"]),
    ("mamba2-1.3b, CP 4, 128K tokens, graphs + checkpointing", "configs/mamba2-1.3b.yaml",
     ["parallel.cp=4", "train.seq_len=131072", "train.micro_batch=1", "train.global_batch=1", "train.cuda_graph=true",
      "train.activation_checkpointing=true"]),
]


def before_runs(cal: Calibration) -> None:
    print("| row (4 x H100 80GB unless it says, NVLink) | predicted tokens/s per GPU | MFU | exposed comm (s a step) | "
          "measured |")
    print("|---|---|---|---|---|")
    for name, path, over in BEFORE:
        base = ["data.builtin=stdlib", "parallel.world_size=4", "parallel.gpus_per_node=4", "train.seq_len=4096",
                "train.micro_batch=1"]
        cfg = load_config(os.path.join(ROOT, path), base + over, validate_config=False)
        p = predict(cfg, cal)
        print(f"| {name} | {p.tokens_per_s_per_gpu:,.0f} | {100 * (p.mfu or 0):.1f}% | {p.exposed_comm_s:.3f} | "
              "not yet |", flush=True)


RECIPE_LINE = "# megassm-plan (docs/planner.md"


def _family_text(lo_hi) -> str:
    if lo_hi is None:
        return "no layout of this family was measured with its collectives"
    lo, hi = (100 * x for x in lo_hi)
    if abs(hi - lo) < 0.5:
        return f"the one layout of this family measured came out {lo:+.0f}%"
    return f"layouts of this family came out {lo:+.0f}..{hi:+.0f}% against measurements"


def recipes(cal: Calibration, write: bool) -> None:
    """Each recipe's predicted figures, with the validation's error range for its layout family."""
    known = class_errors(validate(cal))
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "recipes", "*.yaml"))):
        cfg = load_config(path, ["data.builtin=stdlib"], validate_config=False)
        p = predict(cfg, cal)
        line = (f"{RECIPE_LINE}, calibration of {cal.data.get('date')}, H100 80GB): {p.tokens_per_s_per_gpu:,.0f} "
                f"tokens/s per GPU, {100 * (p.mfu or 0):.1f}% MFU predicted for this layout; "
                f"{_family_text(known.get(layout_class(cfg)))}")
        print(f"{os.path.relpath(path, ROOT)}: {line}")
        if write:
            with open(path) as f:
                lines = f.read().split("\n")
            at = [i for i, x in enumerate(lines) if x.startswith(RECIPE_LINE)]
            if len(at) != 1:
                raise SystemExit(f"{path}: expected one line starting {RECIPE_LINE!r}, found {len(at)}")
            lines[at[0]] = line
            with open(path, "w") as f:
                f.write("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--beyond", action="store_true")
    ap.add_argument("--before-runs", action="store_true")
    ap.add_argument("--recipes", action="store_true")
    ap.add_argument("--write", action="store_true", help="with --recipes: rewrite each recipe's predicted line")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 32, 128])
    ap.add_argument("--calibration", default=default_calibration("h100-80gb"))
    args = ap.parse_args()
    cal = Calibration.load(args.calibration)
    if args.beyond:
        beyond(args.nodes, cal)
    if args.before_runs:
        before_runs(cal)
    if args.recipes:
        recipes(cal, args.write)


if __name__ == "__main__":
    main()
