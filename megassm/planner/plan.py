"""The ranked table of `megassm-plan` (docs/planner.md): every layout of the cluster that the trainer accepts and
that fits the card, with its predicted step, tokens/s per GPU, MFU, exposed communication and pipeline bubble.

Candidates: tensor parallelism inside a node (1, 2, 4, 8 dividing the GPUs per node; with and without SP),
pipeline stages (1, 2, 4 where the depth allows), the data-parallel engine (ddp, its distributed optimizer,
FSDP2 with its reshard modes, HSDP inside a node when the job spans nodes; FSDP2's step sync), the micro-batch
(the config's, halved, doubled) and activation checkpointing; CUDA graphs wherever the trainer takes them. Each is
kept only if config.validate and the trainer's own layout checks accept it (training/layouts.py
candidate_config) and the dry run's estimate fits the card (training/memory.py fits): no second copy of the rules.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import sys

from megassm.config import ConfigError, dump_config, load_config
from megassm.planner.costs import NETWORKS, Calibration, MissingCalibration, predict

__all__ = ["plan", "candidates", "main", "default_calibration"]

EXIT_OK, EXIT_CONFIG = 0, 2
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CARDS = {"h100-80gb": ("H100 80GB", "h100-80gb.json"), "h200-141gb": ("H200 141GB", "h200-141gb.json")}


def default_calibration(gpu: str) -> str:
    return os.path.join(REPO, "configs", "planner", CARDS[gpu][1])


def candidates(cfg, nodes: int, gpus_per_node: int) -> list[dict]:
    """The layout changes to try (dicts of dotted keys), before the trainer's checks and the memory filter."""
    t, p = cfg.train, cfg.parallel
    world = nodes * gpus_per_node
    tps = [x for x in (1, 2, 4, 8) if gpus_per_node % x == 0 and world % x == 0]
    pps = [x for x in (1, 2, 4) if world % x == 0]
    micros = sorted({max(1, t.micro_batch // 2), t.micro_batch, t.micro_batch * 2})
    engines = [{"parallel.engine": "ddp", "parallel.zero_stage": 0}, {"parallel.engine": "ddp", "parallel.zero_stage": 1},
               {"parallel.engine": "fsdp2", "parallel.fsdp_reshard": "step"},
               {"parallel.engine": "fsdp2", "parallel.fsdp_reshard": "block"},
               {"parallel.engine": "fsdp2", "parallel.fsdp_grad_sync": "step"}]
    out = []
    for tp, pp, mb, eng, ac in itertools.product(tps, pps, micros, engines, (False, True)):
        sps = (False, True) if tp > 1 else (False,)
        for sp in sps:
            change = {"parallel.world_size": world, "parallel.gpus_per_node": gpus_per_node, "parallel.tp": tp,
                      "parallel.sp": sp, "parallel.pp": pp, "parallel.cp": p.cp, "train.micro_batch": mb,
                      "train.activation_checkpointing": ac, "parallel.engine": "ddp", "parallel.zero_stage": 0,
                      "parallel.shard_size": 0, "parallel.fsdp_reshard": "step", "parallel.fsdp_grad_sync":
                      "micro_batch", **eng}
            change["train.cuda_graph"] = change["parallel.engine"] == "ddp" and pp == 1
            out.append(change)
            if change["parallel.engine"] == "fsdp2" and nodes > 1:  # HSDP: the shards inside a node
                dp_in_node = gpus_per_node // (tp * p.cp)
                if dp_in_node >= 1:
                    out.append({**change, "parallel.shard_size": dp_in_node})
    return out


def _apply(cfg, change: dict):
    c = copy.deepcopy(cfg)
    for key, value in change.items():
        section, name = key.split(".")
        setattr(getattr(c, section), name, value)
    return c


def plan(cfg, nodes: int, gpus_per_node: int, gpu: str, network: str, cal: Calibration, vocab: int | None = None,
         log=lambda m: None) -> list[dict]:
    """Every accepted layout that fits, with its prediction, fastest first."""
    from megassm.training import memory, traffic
    from megassm.training.layouts import candidate_config

    card = CARDS[gpu][0]
    world = nodes * gpus_per_node
    seen, rows = set(), []
    for change in candidates(cfg, nodes, gpus_per_node):
        key = tuple(sorted(change.items()))
        if key in seen:
            continue
        seen.add(key)
        c = candidate_config(_apply(cfg, {}), change, world)
        if c is None:
            continue
        est = memory.estimate(c, vocab=vocab)
        if not memory.fits(c, est, card):
            continue
        if c.parallel.tp > 1 and not c.train.cuda_graph:
            # eager TP: each collective waits for the slowest host of the TP group, which a one-GPU calibration
            # cannot see (measured: FSDP2 x TP 2 at half its prediction, docs/planner.md); graphed TP is ranked
            log("tensor parallelism without CUDA graphs (host-bound; not predicted: docs/planner.md)")
            continue
        try:
            pred = predict(c, cal, network=network, vocab=vocab)
        except MissingCalibration as e:
            log(str(e))
            continue
        flows = traffic.step_flows(c, vocab=vocab)
        tot = traffic.totals(flows)
        rows.append({"overrides": _overrides(cfg, c), "config": c, "peak_gib": round(est["peak_per_gpu_gib"], 1),
                     "needed_gib": round(memory.needed_gib(c, est), 1), **pred.as_dict(),
                     "inside_gb": round(tot["inside"] / 1e9, 2), "across_gb": round(tot["across"] / 1e9, 2)})
    rows.sort(key=lambda r: -r["tokens_per_s_per_gpu"])
    return rows


_KEYS = ["parallel.world_size", "parallel.gpus_per_node", "parallel.tp", "parallel.sp", "parallel.pp", "parallel.cp",
         "parallel.engine", "parallel.zero_stage", "parallel.shard_size", "parallel.fsdp_reshard",
         "parallel.fsdp_grad_sync", "train.micro_batch", "train.activation_checkpointing", "train.cuda_graph"]


def _overrides(base, c) -> list[str]:
    out = []
    for key in _KEYS:
        section, name = key.split(".")
        v, b = getattr(getattr(c, section), name), getattr(getattr(base, section), name)
        if v != b or key in ("parallel.world_size",):
            out.append(f"{key}={str(v).lower() if isinstance(v, bool) else v}")
    return out


def _bias(r: dict) -> str:
    e = r.get("validated_error")
    return "-" if e is None else f"{100 * e[0]:+.0f}..{100 * e[1]:+.0f}%"


def _table(rows: list[dict], top: int) -> str:
    head = (f"{'#':>3} {'tokens/s/GPU':>12} {'MFU':>6} {'step s':>7} {'comm in/across s':>17} {'bubble':>6} "
            f"{'GiB':>5} {'validated':>11}  layout")
    lines = [head]
    for i, r in enumerate(rows[:top], 1):
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        lines.append(f"{i:>3} {r['tokens_per_s_per_gpu']:>12,.0f} {mfu:>6} {r['step_s']:>7.3f} "
                     f"{r['exposed_inside_s']:>8.3f}/{r['exposed_across_s']:<8.3f} {r['bubble']:>6.2f} "
                     f"{r['needed_gib']:>5.1f} {_bias(r):>11}  "
                     f"{' '.join(o for o in r['overrides'] if not o.startswith('parallel.world_size'))}")
    lines.append("# validated: the prediction's error over the measured rows of the same family (engine, graphs, TP, "
                 "PP: `megassm-plan validate`), '-' where none was measured with its collectives (docs/planner.md)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="megassm-plan", description="Rank the layouts the trainer accepts for a "
                                 "cluster by predicted speed (docs/planner.md). Subcommands: calibrate, validate.")
    ap.add_argument("--config", required=True)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", choices=sorted(CARDS), default="h100-80gb")
    ap.add_argument("--network", choices=sorted(NETWORKS), default="ib400",
                    help="the link across nodes (per GPU): ib400 (400 Gb/s InfiniBand) or eth100 (100 Gb/s)")
    ap.add_argument("--calibration", help="the compute table (default: configs/planner/<gpu>.json)")
    ap.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: the config's)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="one JSON object with every ranked layout")
    ap.add_argument("--write", metavar="RECIPE.yaml", help="write the best layout as a config")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides (before the layout's keys)")
    if argv[:1] == ["validate"]:
        return _validate(argv[1:])
    args = ap.parse_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 1:
        print("megassm-plan: --nodes and --gpus-per-node must be >= 1", file=sys.stderr)
        return EXIT_CONFIG
    cal_path = args.calibration or default_calibration(args.gpu)
    if not os.path.exists(cal_path):
        print(f"megassm-plan: no calibration file {cal_path} for --gpu {args.gpu}: measure one on that GPU with "
              f"`megassm-plan calibrate --out {cal_path}`", file=sys.stderr)
        return EXIT_CONFIG
    world = args.nodes * args.gpus_per_node
    over = ["data.builtin=stdlib", *args.overrides, f"parallel.world_size={world}"]
    if args.global_batch:
        over.append(f"train.global_batch={args.global_batch}")
    try:
        cfg = load_config(args.config, over, validate_config=False)
    except (ConfigError, OSError) as e:
        print(f"megassm-plan: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    cal = Calibration.load(cal_path)
    from megassm.planner.validate import class_errors, layout_class, validate

    known = class_errors(validate(cal)) if cal_path == default_calibration("h100-80gb") else {}
    skipped: dict = {}
    rows = plan(cfg, args.nodes, args.gpus_per_node, args.gpu, args.network, cal,
                log=lambda m: skipped.__setitem__(m, skipped.get(m, 0) + 1))
    for why, n in sorted(skipped.items()):
        print(f"megassm-plan: {n} layout(s) not ranked: {why}", file=sys.stderr)
    if not rows:
        print(f"megassm-plan: no layout of {args.config} that the trainer accepts fits {args.nodes} x "
              f"{args.gpus_per_node} {CARDS[args.gpu][0]} at global batch {cfg.train.global_batch} (raise the global "
              "batch, or use a larger card)", file=sys.stderr)
        return EXIT_CONFIG
    for r in rows:  # what the validation showed for layouts of this family (measured with their collectives)
        lo_hi = known.get(layout_class(r["config"]))
        r["validated_error"] = None if lo_hi is None else [round(lo_hi[0], 3), round(lo_hi[1], 3)]
    if args.json:
        print(json.dumps({"config": args.config, "nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
                          "gpu": args.gpu, "network": args.network, "calibration": cal_path,
                          "layouts": [{k: v for k, v in r.items() if k != "config"} for r in rows]}))
    else:
        print(f"# {args.config} on {args.nodes} x {args.gpus_per_node} {CARDS[args.gpu][0]} ({args.network} across "
              f"nodes), global batch {cfg.train.global_batch} x {cfg.train.seq_len}; calibration {cal_path} "
              f"({cal.gpu}, {cal.data.get('date')}); {len(rows)} layouts fit")
        print(_table(rows, args.top))
    if args.write:
        best = rows[0]
        text = (f"# Written by megassm-plan from {args.config} for {args.nodes} x {args.gpus_per_node} "
                f"{CARDS[args.gpu][0]} ({args.network}): predicted {best['tokens_per_s_per_gpu']:,.0f} tokens/s per "
                f"GPU, {100 * (best['mfu'] or 0):.1f}% MFU, step {best['step_s']:.3f} s, {best['needed_gib']:.1f} GiB "
                f"per GPU (docs/planner.md)\n# layout: {' '.join(best['overrides'])}\n" + dump_config(best["config"]))
        tmp = f"{args.write}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.write)
        print(args.write if not args.json else "", file=sys.stderr if args.json else sys.stdout)
    return EXIT_OK


def _validate(argv: list[str]) -> int:
    from megassm.planner.validate import summary, validate

    ap = argparse.ArgumentParser(prog="megassm-plan validate", description="The prediction beside every measured "
                                 "row of docs/benchmarks.md (docs/planner.md 'Validation').")
    ap.add_argument("--calibration", default=default_calibration("h100-80gb"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cal = Calibration.load(args.calibration)
    res = validate(cal)
    if args.json:
        print(json.dumps({"rows": res, "summary": summary(res)}))
        return EXIT_OK
    print("| row | measured tokens/s per GPU | predicted | error |")
    print("|---|---|---|---|")
    for r in res:
        pred = f"{r['predicted']:,.0f}" if r["predicted"] is not None else f"not predicted: {r.get('why')}"
        err = f"{100 * r['error']:+.1f}%" if r["error"] is not None else ""
        print(f"| {r['name']} | {r['measured']:,.0f} | {pred} | {err} |")
    print(json.dumps(summary(res)))
    return EXIT_OK

